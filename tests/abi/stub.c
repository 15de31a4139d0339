/*
 * A stand-in for the libkvferry an old engine was linked against: only its
 * symbols matter (none of these bodies runs). Built with no version script,
 * it is a libkvferry from before symbol versions; with stub0.map, the
 * libkvferry.so.0 first released with them. The engine then runs against this
 * build's libkvferry (LD_LIBRARY_PATH), as an installed engine meets a newer
 * library.
 */
void kvf_attach(void);
void kvf_detach(void);
void kvf_last_error(void);
void kvf_get_layout(void);
void kvf_submit_task(void);
void kvf_layer_done(void);
void kvf_poll(void);
void kvf_status_name(void);
void kvf_session(void);
void kvf_attach(void) {}
void kvf_detach(void) {}
void kvf_last_error(void) {}
void kvf_get_layout(void) {}
void kvf_submit_task(void) {}
void kvf_layer_done(void) {}
void kvf_poll(void) {}
void kvf_status_name(void) {}
void kvf_session(void) {}
