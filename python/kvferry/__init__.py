"""kvferry for Python engines: libkvferry through ctypes, no build step.

    import kvferry
    with kvferry.Client("rank0") as c:          # attach to the instance `tools/kvferry up` started
        k = c.tensor(layer=0, v=0)              # layer 0's K cache, zero-copy (see Client.tensor)
        c.submit_task({"request_id": "r1", "src_block_ids": [3, 4], "dest_block_ids": [7, 8],
                       "current_id": step, "transfer_protocol": "ipc", "peer": "decode0"})
        ... write the layer into the blocks ...
        c.layer_done(step, layer)
        ev = c.poll(timeout_ms=1000)            # {"type": "completion", "status": "finished", ...}

Task, chunk, cancel and connect records are FastDeploy's dicts as they are (docs/records.md):
they go to the instance encoded with msgpack (Debian's python3-msgpack) and the sender checks
them; a bad one ends its request with a status ("bad task", "block id out of range", ...) and
nothing else. Errors of the calls themselves raise KvferryError (an OSError: .errno and
kvferry's message); a full ring raises RingFull (a BlockingIOError): nothing was written, try
again later.

The library is found at $KVFERRY_LIB, else in $KVFERRY_BUILD, else in this package's own folder,
else in the build/ folder of the repository this package sits in, else where the dynamic linker
finds libkvferry.so.0, else in the lib/ folder of the prefix the package is installed in.

The structs below repeat kvferry.h; at import the package checks each field's offset and size,
and the constants it uses, against what the library reports (kvf_abi_info), and refuses a
library of another ABI (ImportError naming both). Calls pass the struct sizes they use
(kvf_poll_sized ...), so a newer library whose structs grew at their end still serves it.
"""
import ctypes
import ctypes.util
import errno as _errno
import os
import fcntl
import threading
import weakref

__all__ = ["Client", "KvferryError", "RingFull", "Layout", "DeviceTensor", "STATUS_NAMES",
           "library_path", "host_buffer"]

ABI = 1  # KVFERRY_ABI of the kvferry.h this package repeats
VERSION = "0.1.0"  # KVFERRY_VERSION of that header
_DTYPES = {1: ("bf16", 2), 2: ("fp16", 2), 3: ("fp8", 1), 4: ("uint8", 1), 5: ("fp32", 4)}


class KvferryError(OSError):
    """A libkvferry call failed: errno and kvferry's own message."""


class RingFull(KvferryError, BlockingIOError):
    """The ring to the instance is full (back-pressure): nothing was written."""


class _Layout(ctypes.Structure):
    _fields_ = [("num_layers", ctypes.c_uint32), ("extra_layers", ctypes.c_uint32),
                ("num_blocks", ctypes.c_uint32), ("kv_heads", ctypes.c_uint32),
                ("block_size", ctypes.c_uint32), ("head_dim", ctypes.c_uint32),
                ("dtype", ctypes.c_uint32), ("key_only", ctypes.c_uint32),
                ("block_bytes", ctypes.c_uint64), ("cache_bytes", ctypes.c_uint64),
                ("scale_dtype", ctypes.c_uint32), ("reserved", ctypes.c_uint32),
                ("scale_bytes", ctypes.c_uint64)]


class _Event(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("session", ctypes.c_uint64), ("status", ctypes.c_int),
                ("request_id", ctypes.c_char * 128), ("peer", ctypes.c_char * 112),
                ("reason", ctypes.c_char * 240), ("bytes", ctypes.c_uint64),
                ("blocks", ctypes.c_uint32), ("rank", ctypes.c_uint32),
                ("accept_ns", ctypes.c_uint64), ("last_layer_ns", ctypes.c_uint64),
                ("done_ns", ctypes.c_uint64),
                ("dest_block_ids", ctypes.POINTER(ctypes.c_uint32)), ("n_dest", ctypes.c_uint32),
                ("flags", ctypes.c_uint32)]


# The constants the package uses, by their names in kvferry.h: values from the library (_abi_check).
_CONSTANTS = ("KVF_STATUS_COUNT", "KVF_EVENT_ID_BIN", "KVF_TO_SENDER", "KVF_TO_CONNECTOR",
              "KVF_REC_TASK", "KVF_REC_CHUNK", "KVF_REC_CANCEL", "KVF_REC_CONNECT",
              "KVF_EVENT_COMPLETION", "KVF_EVENT_ARRIVAL", "KVF_EVENT_CONNECT_RESULT",
              "KVF_TRANSPORT_IPC", "KVF_TRANSPORT_TCP", "KVF_TRANSPORT_RDMA",
              "KVF_SIGNAL_DEFAULT", "KVF_SIGNAL_HOSTFN", "KVF_SIGNAL_WRITEVALUE")


class _RegRegion(ctypes.Structure):
    _fields_ = [("addr", ctypes.c_void_p), ("bytes", ctypes.c_uint64), ("fd", ctypes.c_int),
                ("pad", ctypes.c_uint32), ("fd_offset", ctypes.c_uint64)]


class _RegView(ctypes.Structure):
    _fields_ = [("layer", ctypes.c_uint32), ("tensor", ctypes.c_uint32),
                ("addr", ctypes.c_void_p), ("block_stride", ctypes.c_uint64)]


class _Registration(ctypes.Structure):
    _fields_ = [("regions", ctypes.POINTER(_RegRegion)), ("n_regions", ctypes.c_uint32),
                ("pad", ctypes.c_uint32), ("views", ctypes.POINTER(_RegView)),
                ("n_views", ctypes.c_uint32), ("token_major", ctypes.c_uint32),
                ("device", ctypes.c_int), ("pad2", ctypes.c_uint32)]


def library_path():
    """Where libkvferry is taken from (see the module's text)."""
    if os.environ.get("KVFERRY_LIB"):
        return os.environ["KVFERRY_LIB"]
    here = os.path.dirname(os.path.abspath(__file__))
    builds = [os.environ.get("KVFERRY_BUILD"), here, os.path.join(here, "..", "..", "build")]
    for b in builds:
        if b and os.path.exists(os.path.join(b, "libkvferry.so.0")):
            return os.path.normpath(os.path.join(b, "libkvferry.so.0"))
    found = ctypes.util.find_library("kvferry")
    if found:
        return found
    # The prefix's lib/: sys.prefix (pip into /usr/local, a venv), and the prefix whose
    # lib/pythonX.Y/site-packages holds this package (pip install --prefix P).
    import sys
    prefixes = [sys.prefix, os.path.join(here, "..", "..", "..", "..")]
    for p in prefixes:
        cand = os.path.normpath(os.path.join(p, "lib", "libkvferry.so.0"))
        if os.path.exists(cand):
            return cand
    raise ImportError("kvferry: libkvferry not found: set KVFERRY_LIB to libkvferry.so.0, or "
                      "KVFERRY_BUILD to the build folder, or install it (cmake --install) where "
                      "the dynamic linker or this prefix (%s) finds it" % sys.prefix)


def _abi_check(info, path, lib_version):
    """Check the structs and constants above against `info` (name -> the library's value, None
    for a name it does not know); returns the constants. ImportError naming both versions when
    they differ. $KVFERRY_TEST_LIBRARY_ABI stands in for the ABI the library reports (tests)."""
    lib_abi = os.environ.get("KVFERRY_TEST_LIBRARY_ABI") or info("abi")
    lib_abi = None if lib_abi is None else int(lib_abi)
    here = "the kvferry Python package (kvferry %s, ABI %d)" % (VERSION, ABI)
    there = "%s (kvferry %s, ABI %s)" % (path, lib_version or "of a release without kvf_abi_info",
                                         "unknown" if lib_abi is None else lib_abi)
    if lib_abi != ABI:
        raise ImportError("kvferry: %s cannot use %s: install the package and the library of "
                          "one kvferry release" % (here, there))
    wrong = []
    for struct, ctype in (("kvf_event", _Event), ("kvf_layout_info", _Layout),
                          ("kvf_reg_region", _RegRegion), ("kvf_reg_view", _RegView),
                          ("kvf_registration", _Registration)):
        for name, _ in ctype._fields_:
            field = getattr(ctype, name)
            for what, mine in (("offsetof", field.offset), ("sizeof", field.size)):
                theirs = info("%s %s.%s" % (what, struct, name))
                if theirs != mine:
                    wrong.append("%s %s.%s: %s here, %s there" % (what, struct, name, mine, theirs))
        if (info("sizeof " + struct) or 0) < ctypes.sizeof(ctype):
            wrong.append("sizeof %s: %d here, %s there" % (struct, ctypes.sizeof(ctype),
                                                           info("sizeof " + struct)))
    consts = {}
    for name in _CONSTANTS:
        consts[name] = info(name)
        if consts[name] is None:
            wrong.append("%s: unknown there" % name)
    if wrong:
        raise ImportError("kvferry: %s does not match %s: %s" % (here, there, "; ".join(wrong)))
    return consts


def _load():
    path = library_path()
    lib = ctypes.CDLL(path)
    try:
        abi_info = lib.kvf_abi_info
        lib.kvf_version.restype = ctypes.c_char_p
        lib_version = lib.kvf_version().decode()
    except AttributeError:
        abi_info, lib_version = None, None
    if abi_info is not None:
        abi_info.restype, abi_info.argtypes = ctypes.c_int64, [ctypes.c_char_p]
    def info(name):
        if abi_info is None:
            return None
        v = abi_info(name.encode())
        return None if v < 0 else int(v)
    consts = _abi_check(info, path, lib_version)
    p, i, u32, u64 = ctypes.c_void_p, ctypes.c_int, ctypes.c_uint32, ctypes.c_uint64
    sz = ctypes.c_size_t
    sigs = {
        "kvf_status_name": (ctypes.c_char_p, [i]),
        "kvf_last_error": (ctypes.c_char_p, []),
        "kvf_attach": (i, [ctypes.c_char_p, ctypes.c_uint, ctypes.POINTER(p)]),
        "kvf_detach": (None, [p]),
        "kvf_session": (u64, [p]),
        "kvf_poll_previous_sized": (i, [p, ctypes.POINTER(_Event), sz]),
        "kvf_get_layout_sized": (i, [p, ctypes.POINTER(_Layout), sz]),
        "kvf_cache_tensor": (p, [p, u32, i]),
        "kvf_cache_device": (i, [p]),
        "kvf_submit_raw": (i, [p, i, i, ctypes.c_char_p, ctypes.c_size_t]),
        "kvf_layer_done": (i, [p, u64, u32]),
        "kvf_last_step": (u64, [p]),
        "kvf_layer_done_on_stream": (i, [p, p, u64, u32]),
        "kvf_set_layer_signal": (i, [p, i]),
        "kvf_poll_sized": (i, [p, ctypes.POINTER(_Event), sz, i]),
        "kvf_register_caches_sized": (i, [p, ctypes.POINTER(_Registration), sz]),
        "kvf_unregister_caches": (i, [p]),
    }
    for name, (res, args) in sigs.items():
        f = getattr(lib, name)
        f.restype, f.argtypes = res, args
    return lib, consts


_lib, _C = _load()
_STATUS_COUNT = _C["KVF_STATUS_COUNT"]
_EVENT_ID_BIN = _C["KVF_EVENT_ID_BIN"]
_TO_SENDER, _TO_CONNECTOR = _C["KVF_TO_SENDER"], _C["KVF_TO_CONNECTOR"]
_REC_TASK, _REC_CHUNK, _REC_CANCEL, _REC_CONNECT = (_C["KVF_REC_TASK"], _C["KVF_REC_CHUNK"],
                                                    _C["KVF_REC_CANCEL"], _C["KVF_REC_CONNECT"])
_EVENT_TYPES = {_C["KVF_EVENT_COMPLETION"]: "completion", _C["KVF_EVENT_ARRIVAL"]: "arrival",
                _C["KVF_EVENT_CONNECT_RESULT"]: "connect result"}
_TRANSPORTS = {_C["KVF_TRANSPORT_IPC"]: "ipc", _C["KVF_TRANSPORT_TCP"]: "tcp",
               _C["KVF_TRANSPORT_RDMA"]: "rdma"}
STATUS_NAMES = tuple(_lib.kvf_status_name(s).decode() for s in range(_STATUS_COUNT))


def _check(rc, what):
    if rc >= 0:
        return rc
    msg = "%s: %s" % (what, (_lib.kvf_last_error() or b"").decode(errors="replace"))
    if -rc == _errno.EAGAIN:
        raise RingFull(-rc, msg)
    raise KvferryError(-rc, msg)


# -- the engine's caches ------------------------------------------------------------------------

_host_buffers = {}  # start address -> (fd, nbytes): the memory register_caches accepts
_host_lock = threading.Lock()


def _buffer_closed(addr):
    with _host_lock:
        fd = _host_buffers.pop(addr, (None,))[0]
    if fd is not None:
        os.close(fd)


def host_buffer(nbytes):
    """nbytes of host memory the instance's roles can map: a memfd shared mapping, as a NumPy
    uint8 array (torch.frombuffer(buf, dtype=...) makes a tensor of it, zero-copy). The only
    host memory Client.register_caches accepts: carve the caches out of it (reshape, slice,
    view as another dtype); the memory lives while any view of it does. Its file is sealed
    against shrinking (F_SEAL_SHRINK): the roles map it, and a shrunk file would fault."""
    import mmap
    import numpy as np
    nbytes = int(nbytes)
    if nbytes <= 0:
        raise KvferryError(_errno.EINVAL, "kvferry: host_buffer of %d bytes" % nbytes)
    fd = os.memfd_create("kvferry-engine-caches", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
        os.ftruncate(fd, nbytes)
        # It cannot shrink under the roles' mappings (their copies would fault).
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK)
        mm = mmap.mmap(fd, nbytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
    except BaseException:
        os.close(fd)
        raise
    arr = np.frombuffer(mm, dtype=np.uint8)
    addr = arr.__array_interface__["data"][0]
    with _host_lock:
        _host_buffers[addr] = (fd, nbytes)
    weakref.finalize(arr, _buffer_closed, addr)
    return arr


def _tensor_info(t):
    """(address, shape, strides in bytes, item size, device: -1 host) of a NumPy array or a
    torch tensor."""
    if hasattr(t, "data_ptr") and hasattr(t, "element_size"):  # torch, imported by the caller
        es = t.element_size()
        dev = -1 if t.device.type == "cpu" else (t.device.index or 0)
        return t.data_ptr(), tuple(t.shape), tuple(x * es for x in t.stride()), es, dev
    cai = getattr(t, "__cuda_array_interface__", None)
    if cai is not None:  # CuPy, or anything that speaks CUDA's array interface
        shape = tuple(cai["shape"])
        es = int(_np_itemsize(cai["typestr"]))
        st = cai.get("strides")
        if st is None:  # C-contiguous
            st, acc = [], es
            for d in reversed(shape):
                st.insert(0, acc)
                acc *= d
        dev = getattr(getattr(t, "device", None), "id", None)
        if dev is None:
            raise KvferryError(_errno.EINVAL, "kvferry: register caches: %s gives no device "
                               "(.device.id): give a CuPy array or a torch tensor"
                               % type(t).__name__)
        return int(cai["data"][0]), shape, tuple(int(x) for x in st), es, int(dev)
    ai = getattr(t, "__array_interface__", None)
    if ai is None:
        raise KvferryError(_errno.EINVAL, "kvferry: register caches: %s is neither a NumPy "
                           "array, a torch tensor nor a CuPy array" % type(t).__name__)
    return ai["data"][0], tuple(t.shape), tuple(t.strides), t.itemsize, -1


def _np_itemsize(typestr):
    """Bytes of an element of an array interface's typestr ("<f2", "|u1", "<V2": bf16)."""
    try:
        return int(typestr[2:])
    except ValueError:
        raise KvferryError(_errno.EINVAL, "kvferry: register caches: element type %r" % typestr)


def _one_device(device, dev, what):
    """The registration's device so far, with entry `what` on dev: all on one."""
    if device is None or device == dev:
        return dev
    kind = lambda d: "host memory" if d < 0 else "GPU %d" % d
    raise KvferryError(_errno.EINVAL, "kvferry: register caches: %s is in %s, the tensors "
                       "before it in %s: every tensor in one kind of memory, on one GPU"
                       % (what, kind(dev), kind(device)))


def _block_views(t, what, lo):
    """The views of one layer entry's tensor: [(tensor index, address, block stride)]."""
    addr, shape, strides, es, dev = _tensor_info(t)
    nb, bb = lo.num_blocks, lo.block_bytes

    def block_check(dims, st, name):
        want = es
        for d, x in reversed(list(zip(dims, st))):
            if d != 1 and x != want:
                raise KvferryError(_errno.EINVAL, "kvferry: register caches: %s: a block is not "
                                   "contiguous (shape %r, strides %r bytes): make it so (.contiguous())"
                                   % (name, shape, strides))
            want *= d
        if want != bb:
            raise KvferryError(_errno.EINVAL, "kvferry: register caches: %s: a block is %d bytes "
                               "(shape %r), the instance's is %d (block_size %d x %d heads x head_dim "
                               "%d x %d bytes): the layout does not fit"
                               % (name, want, tuple(dims), bb, lo.block_size, lo.kv_heads,
                                  lo.head_dim, es))

    if len(shape) >= 2 and shape[0] == 2 and shape[1] == nb and not lo.key_only:
        # stacked [2, blocks, ...] (also chosen for [2, 2, ...] when the instance has 2 blocks)
        block_check(shape[2:], strides[2:], what)
        return [(0, addr, strides[1]), (1, addr + strides[0], strides[1])], dev
    if len(shape) >= 2 and shape[0] == nb and shape[1] == 2 and not lo.key_only:
        # blocks-first [blocks, 2, ...]
        block_check(shape[2:], strides[2:], what)
        return [(0, addr, strides[0]), (1, addr + strides[1], strides[0])], dev
    if len(shape) >= 1 and shape[0] == nb and lo.key_only:
        block_check(shape[1:], strides[1:], what)
        return [(0, addr, strides[0])], dev
    raise KvferryError(_errno.EINVAL, "kvferry: register caches: %s has shape %r: give a (K, V) "
                       "pair of [blocks, ...] tensors, a stacked [2, blocks, ...] or a blocks-first "
                       "[blocks, 2, ...] tensor%s, with blocks = %d"
                       % (what, shape, " (key only: one [blocks, ...] tensor)" if lo.key_only
                          else "", nb))


def _one_tensor(t, what, lo):
    addr, shape, strides, es, dev = _tensor_info(t)
    if len(shape) < 1 or shape[0] != lo.num_blocks:
        raise KvferryError(_errno.EINVAL, "kvferry: register caches: %s has shape %r: its first "
                           "dimension must be the instance's %d blocks" % (what, shape,
                                                                            lo.num_blocks))
    return addr, strides[0], shape, strides, es, dev


def _block_views_check(shape, strides, es, lo, what):
    want = es
    for d, x in reversed(list(zip(shape[1:], strides[1:]))):
        if d != 1 and x != want:
            raise KvferryError(_errno.EINVAL, "kvferry: register caches: %s: a block is not "
                               "contiguous (shape %r, strides %r bytes): make it so (.contiguous())"
                               % (what, shape, strides))
        want *= d
    if want != lo.block_bytes:
        raise KvferryError(_errno.EINVAL, "kvferry: register caches: %s: a block is %d bytes "
                           "(shape %r), the instance's is %d: the layout does not fit"
                           % (what, want, shape, lo.block_bytes))


def _host_region(addr):
    with _host_lock:
        for start, (fd, n) in _host_buffers.items():
            if start <= addr < start + n:
                return start, n, fd
    return None


class Layout:
    """An instance's cache layout (struct kvf_layout_info), and each tensor's shape."""

    def __init__(self, li):
        for name, _ in _Layout._fields_:
            setattr(self, name, int(getattr(li, name)))
        self.dtype_name, self.itemsize = _DTYPES.get(self.dtype, ("unknown", 1))
        self.tensors = 1 if self.key_only else 2

    @property
    def shape(self):
        """One layer's tensor: [num_blocks, kv_heads, block_size, head_dim]."""
        return (self.num_blocks, self.kv_heads, self.block_size, self.head_dim)

    @property
    def tensor_bytes(self):
        return self.num_blocks * self.block_bytes

    @property
    def scale_dtype_name(self):
        """The scale tensors' dtype ("bf16", "fp32", ...), None when the layout has none."""
        return _DTYPES.get(self.scale_dtype, ("unknown", 1))[0] if self.scale_bytes else None

    @property
    def scale_shape(self):
        """One scale tensor: [num_blocks, kv_heads, block_size] (a block's row scales it)."""
        return (self.num_blocks, self.kv_heads, self.block_size)

    def __repr__(self):
        scales = (", %s scale tensors of %d bytes per block" % (self.scale_dtype_name, self.scale_bytes)
                  if self.scale_bytes else "")
        return ("Layout(%d+%d layers x %d tensor(s), %d blocks of %d x %d x %d %s, %d bytes "
                "per block%s)" % (self.num_layers, self.extra_layers, self.tensors,
                                  self.num_blocks, self.kv_heads, self.block_size, self.head_dim,
                                  self.dtype_name, self.block_bytes, scales))


class DeviceTensor:
    """One layer's tensor in GPU memory: the device pointer, and the CUDA array interface, so
    that torch.as_tensor(t, device="cuda") or cupy.asarray(t) see it without a copy. bf16 is
    given as raw 16-bit words ("<i2"; .view(torch.bfloat16)), fp8 as bytes."""

    _TYPESTR = {1: "<i2", 2: "<f2", 3: "|u1", 4: "|u1", 5: "<f4"}

    def __init__(self, ptr, layout, device, client, scale=False):
        self.ptr, self.layout, self.device = ptr, layout, device
        self.shape = layout.scale_shape if scale else layout.shape
        self._dtype = layout.scale_dtype if scale else layout.dtype
        self._client = client  # the mapping lives while this does (torch keeps it alive too)

    @property
    def __cuda_array_interface__(self):
        return {"shape": self.shape, "typestr": self._TYPESTR.get(self._dtype, "|u1"),
                "data": (self.ptr, False), "version": 3, "strides": None}

    def __repr__(self):
        return "DeviceTensor(0x%x on GPU %d, %r)" % (self.ptr, self.device, self.shape)


def _event_dict(ev):
    d = {
        "type": _EVENT_TYPES.get(ev.type, "unknown"),
        "session": int(ev.session),
        "status": STATUS_NAMES[ev.status] if 0 <= ev.status < _STATUS_COUNT else "unknown status",
        # An id submitted as bytes comes back as the same bytes; a str id as str.
        "request_id": ev.request_id if ev.flags & _EVENT_ID_BIN else
        ev.request_id.decode(errors="replace"),
        "peer": ev.peer.decode(errors="replace"),
        "reason": ev.reason.decode(errors="replace"),
        "bytes": int(ev.bytes),
        "blocks": int(ev.blocks),
        "rank": int(ev.rank),
    }
    if ev.type == _C["KVF_EVENT_COMPLETION"]:
        d.update(accept_ns=int(ev.accept_ns), last_layer_ns=int(ev.last_layer_ns),
                 done_ns=int(ev.done_ns))
    elif ev.type == _C["KVF_EVENT_ARRIVAL"]:
        d["done_ns"] = int(ev.done_ns)
        if ev.accept_ns:  # same host: when the prefill sender posted its finish notice
            d["accept_ns"] = int(ev.accept_ns)
        # valid only until the next poll: copied out here
        d["dest_block_ids"] = [ev.dest_block_ids[j] for j in range(ev.n_dest)] \
            if ev.dest_block_ids else []
    return d


class Client:
    """One engine session on one instance (kvf_attach). Closing it (or the process ending)
    ends the session: its requests still moving end with "engine gone" on both sides.

    The host caches' views (tensor(), block(), numpy()) point into the client's mapping of
    the caches. A view keeps its client alive, and close() with views still alive ends the
    session only when the last of them is gone (`closed` says whether it has): a view never
    points at unmapped memory. Threads may share a client; close() from one thread while
    another is in a call (a poll that waits) takes effect when that call returns, and calls
    after close() raise. A client belongs to the process that made it: in a child forked
    after that, every call raises KvferryError (EBADF, "this client was attached by pid N;
    after fork() attach anew in the child"), and closing it there ends nothing of the
    parent's session."""

    def __init__(self, instance, wait_ms=5000):
        self._h = None
        self.instance = instance
        self._msgpack = None
        self._views = {}  # id -> weakref of each live view's memory
        self._closing = False
        self._active = 0  # calls into the library in progress
        self._lock = threading.RLock()  # re-entrant: a view may die (GC) inside a locked region
        self._pid = os.getpid()  # a forked child must attach anew (see _call)
        h = ctypes.c_void_p()
        _check(_lib.kvf_attach(instance.encode(), int(wait_ms), ctypes.byref(h)), "kvferry")
        self._h = h
        try:
            li = _Layout()
            _check(_lib.kvf_get_layout_sized(self._h, ctypes.byref(li), ctypes.sizeof(li)),
                   "layout")
            self.layout = Layout(li)
            dev = _lib.kvf_cache_device(self._h)
            self.device = None if dev < 0 else dev  # None: the caches are host memory
        except BaseException:
            self.close()
            raise

    # -- session ---------------------------------------------------------------------------

    def close(self):
        """End the session now, or as soon as the last view of the caches is gone and the
        calls other threads are making have returned."""
        with self._lock:
            self._closing = True
            self._detach_if_done()

    @property
    def closed(self):
        return self._h is None

    def _detach_if_done(self):  # with self._lock held
        if self._h and self._closing and not self._views and not self._active:
            h, self._h = self._h, None
            _lib.kvf_detach(h)

    def _view_gone(self, ref):
        with self._lock:
            self._views.pop(id(ref), None)
            self._detach_if_done()

    def _call(self, fn, *args):
        """fn(handle, *args), the handle kept valid until it returns. In a child forked after the
        attach every call raises, as libkvferry refuses it: the session is the parent's."""
        if os.getpid() != self._pid:
            raise KvferryError(_errno.EBADF, "kvferry: this client was attached by pid %d; after "
                               "fork() attach anew in the child (pid %d)"
                               % (self._pid, os.getpid()))
        with self._lock:
            if not self._h or self._closing:
                raise KvferryError(_errno.EBADF, "kvferry: client of '%s' closed" %
                                   self.instance)
            self._active += 1
            h = self._h
        try:
            return fn(h, *args)
        finally:
            with self._lock:
                self._active -= 1
                self._detach_if_done()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __del__(self):
        try:
            self.close()
        except Exception:  # interpreter shutting down
            pass

    @property
    def session(self):
        return int(self._call(_lib.kvf_session))

    @property
    def last_step(self):
        """The last step with a published layer-done: a re-attached engine counts on from it."""
        return int(self._call(_lib.kvf_last_step))

    # -- caches ----------------------------------------------------------------------------

    def tensor(self, layer, v=0):
        """Layer `layer`'s K (v=0) or V (v=1) cache, zero-copy: for a host instance a writable
        memoryview of its bytes (numpy.frombuffer takes it as it is), for a GPU instance a
        DeviceTensor. A view keeps the caches mapped in this process (see the class). Extra
        layers follow the model's layers."""
        return self._tensor(layer, v, False)

    def scale_tensor(self, layer, v=0):
        """The per-block scales of layer `layer`'s K (v=0) or V (v=1) tensor, in an instance
        whose layout has scale tensors (`up --scale-dtype`; FastDeploy's block_wise_fp8
        caches): [num_blocks, kv_heads, block_size] of layout.scale_dtype_name, moved with
        their blocks. A memoryview (host) or a DeviceTensor (GPU), as tensor()."""
        if not self.layout.scale_bytes:
            raise KvferryError(_errno.ERANGE, "kvferry: the layout has no scale tensors (%r)"
                               % (self.layout,))
        return self._tensor(layer, v, True)

    def _tensor(self, layer, v, scale):
        lo = self.layout
        if not (0 <= layer < lo.num_layers + lo.extra_layers) or v not in (0, 1) or \
                (v and lo.key_only):
            raise KvferryError(_errno.ERANGE, "kvferry: no %stensor %d of layer %d (%r)"
                               % ("scale " if scale else "", v, layer, lo))
        with self._lock:  # the view is registered before another thread's close() can unmap
            ptr = self._call(_lib.kvf_cache_tensor, layer, v + (lo.tensors if scale else 0))
            if not ptr:
                _check(-_errno.ERANGE, "tensor %d of layer %d" % (v, layer))
            if self.device is not None:
                mem = DeviceTensor(ptr, lo, self.device, self, scale)
            else:
                mem = (ctypes.c_ubyte * (lo.num_blocks * lo.scale_bytes if scale
                                         else lo.tensor_bytes)).from_address(ptr)
                mem._client = self  # the mapping lives while the view does
            ref = weakref.ref(mem, self._view_gone)
            self._views[id(ref)] = ref
        return mem if self.device is not None else memoryview(mem).cast("B")

    def block(self, layer, v, block_id):
        """One block of one layer's tensor (host instances): a writable memoryview."""
        if not 0 <= block_id < self.layout.num_blocks:
            raise KvferryError(_errno.ERANGE, "kvferry: block %d of %d" %
                               (block_id, self.layout.num_blocks))
        bb = self.layout.block_bytes
        return self.tensor(layer, v)[block_id * bb:(block_id + 1) * bb]

    def numpy(self, layer, v=0):
        """tensor() as a numpy array of the layer's shape (host instances; bf16 as int16)."""
        import numpy as np
        kinds = {1: np.int16, 2: np.float16, 3: np.uint8, 4: np.uint8}
        t = self.tensor(layer, v)
        if isinstance(t, DeviceTensor):
            raise KvferryError(_errno.EINVAL, "kvferry: the caches are on GPU %d: use "
                               "torch.as_tensor(client.tensor(...), device='cuda')" % self.device)
        return np.frombuffer(t, dtype=kinds.get(self.layout.dtype, np.uint8)).reshape(
            self.layout.shape)

    # -- the engine's caches -----------------------------------------------------------------

    def register_caches(self, caches, token_major=False):
        """Hand the instance (started with --caches engine) the engine's own caches: a list
        with one entry per layer (model layers, then extra layers), each a (K, V) pair of
        [blocks, ...] tensors, a stacked [2, blocks, ...] tensor, a blocks-first
        [blocks, 2, ...] tensor (blocks apart by 2 blocks), or one [blocks, ...] tensor (key
        only). A [2, 2, ...] tensor, on an instance of 2 blocks, is read as stacked (vLLM's
        layout): give a (K, V) pair for blocks-first. NumPy arrays or torch tensors; host
        memory from kvferry.host_buffer() (anything else: KvferryError "foreign memory"). On
        an instance started with --caches engine --backend cuda: CUDA torch tensors or CuPy
        arrays on the instance's GPU, from cudaMalloc'd memory (PyTorch's caching allocator
        with expandable segments off; each allocation is shared once, however many tensors
        it holds). A block is contiguous; token_major: a block is [block_size, heads, head_dim] (vLLM),
        else [heads, block_size, head_dim]. Several layers may share one buffer; each buffer
        is one region. The registration lasts until unregister_caches(), close(), or this
        process's end."""
        lo = self.layout
        nl = lo.num_layers + lo.extra_layers
        caches = list(caches)
        if len(caches) != nl:
            raise KvferryError(_errno.EINVAL, "kvferry: register caches: %d layer entries, the "
                               "instance has %d layers" % (len(caches), nl))
        views, device = [], None
        for layer, entry in enumerate(caches):
            if isinstance(entry, (tuple, list)):
                if len(entry) != (1 if lo.key_only else 2):
                    raise KvferryError(_errno.EINVAL, "kvferry: register caches: layer %d: %d "
                                       "tensors, want %s" % (layer, len(entry), "K" if lo.key_only
                                                             else "(K, V)"))
                got = []
                for v, t in enumerate(entry):
                    what = "layer %d %s" % (layer, "KV"[v])
                    addr, stride, shape, strides, es, dev = _one_tensor(t, what, lo)
                    # a block: every dimension after the first, contiguous
                    _block_views_check(shape, strides, es, lo, what)
                    got.append((v, addr, stride))
                    device = _one_device(device, dev, what)
            else:
                got, dev = _block_views(entry, "layer %d" % layer, lo)
                device = _one_device(device, dev, "layer %d" % layer)
            views += [(layer, v, addr, stride) for v, addr, stride in got]
        device = -1 if device is None else device
        regions = {}
        if device < 0:
            for layer, v, addr, stride in views:
                r = _host_region(addr)
                if r is None:
                    raise KvferryError(_errno.EINVAL, "kvferry: register caches: layer %d %s: foreign "
                                       "memory at 0x%x: the engine's host caches must live in "
                                       "kvferry.host_buffer() memory (a file the instance's roles "
                                       "can map)" % (layer, "KV"[v], addr))
                regions[r[0]] = r
            regs = [(start, n, fd, 0) for start, n, fd in regions.values()]
        else:
            # GPU memory: the library finds each tensor's allocation (cuMemGetAddressRange)
            # and sends each allocation's IPC handle once
            regs = []
        self.register_raw(views, regs, token_major=token_major, device=device)
        self._registered = caches  # the memory stays referenced while registered

    def register_raw(self, views, regions, token_major=False, device=-1):
        """register_caches with raw pointers: views = [(layer, tensor, addr, block_stride)],
        regions = [(addr, bytes, fd, fd_offset)] (host: fd a memfd or /dev/shm file that maps
        the region; GPU: fd -1 and addr the start of an allocation, or no regions at all: the
        library finds the allocations behind the views)."""
        rv = (_RegView * max(1, len(views)))()
        for i, (layer, v, addr, stride) in enumerate(views):
            rv[i] = _RegView(int(layer), int(v), int(addr), int(stride))
        rr = (_RegRegion * max(1, len(regions)))()
        for i, (addr, n, fd, off) in enumerate(regions):
            rr[i] = _RegRegion(int(addr), int(n), int(fd), 0, int(off))
        reg = _Registration(rr, len(regions), 0, rv, len(views), 1 if token_major else 0,
                            int(device), 0)
        _check(self._call(_lib.kvf_register_caches_sized, ctypes.byref(reg),
                          ctypes.sizeof(reg)), "kvferry")

    def unregister_caches(self):
        """Take the registration back: the instance waits for the engine's caches again."""
        _check(self._call(_lib.kvf_unregister_caches), "kvferry")
        self._registered = None

    # -- records ---------------------------------------------------------------------------

    def _raw(self, target, rtype, record, what):
        if self._msgpack is None:
            try:
                import msgpack
            except ImportError:
                raise ImportError("kvferry: records need the msgpack module (Debian: "
                                  "python3-msgpack)") from None
            self._msgpack = msgpack
        data = self._msgpack.packb(record, use_bin_type=True)
        return _check(self._call(_lib.kvf_submit_raw, target, rtype, data, len(data)), what)

    def submit_task(self, task):
        """One request to move: FastDeploy's task dict as it is (docs/records.md, record 1)."""
        return self._raw(_TO_SENDER, _REC_TASK, task, "task")

    def submit_chunk(self, request_id, step, tokens_done, last=False):
        """Chunked prefill: after `step`, tokens [0, tokens_done) of the request are written."""
        return self._raw(_TO_SENDER, _REC_CHUNK, {"request_id": request_id, "current_id": step,
                                                  "tokens_done": tokens_done, "last": bool(last)},
                         "chunk")

    def cancel(self, request_id):
        return self._raw(_TO_SENDER, _REC_CANCEL, {"request_id": request_id}, "cancel")

    def connect(self, task_id, peer, transfer_protocol=None):
        """Pre-connect to a peer; the answer comes from poll() as a "connect result"."""
        rec = {"task_id": task_id, "peer": peer}
        if transfer_protocol:
            rec["transfer_protocol"] = transfer_protocol
        return self._raw(_TO_CONNECTOR, _REC_CONNECT, rec, "connect")

    # -- layers ----------------------------------------------------------------------------

    def layer_done(self, step, layer):
        """Layers [0, layer] of forward step `step` are written (monotonic)."""
        return _check(self._call(_lib.kvf_layer_done, int(step), int(layer)), "layer done")

    def layer_done_on_stream(self, stream, step, layer):
        """layer_done() when the CUDA stream reaches this point; `stream` is the cudaStream_t
        as an int (torch: torch.cuda.current_stream().cuda_stream)."""
        return _check(self._call(_lib.kvf_layer_done_on_stream, ctypes.c_void_p(int(stream)),
                                                    int(step), int(layer)),
                      "layer done on stream")

    def set_layer_signal(self, method):
        """"hostfn" or "writevalue", before the first layer_done_on_stream()."""
        m = {"default": _C["KVF_SIGNAL_DEFAULT"], "hostfn": _C["KVF_SIGNAL_HOSTFN"],
             "writevalue": _C["KVF_SIGNAL_WRITEVALUE"]}.get(method)
        if m is None:
            raise KvferryError(_errno.EINVAL, "kvferry: layer signal '%s': hostfn or "
                               "writevalue" % method)
        return _check(self._call(_lib.kvf_set_layer_signal, m), "layer signal")

    # -- events ----------------------------------------------------------------------------

    def poll(self, timeout_ms=0):
        """The next completion, arrival or connect result of this session, as a dict, or None
        when none came within timeout_ms (-1 waits)."""
        ev = _Event()
        if _check(self._call(_lib.kvf_poll_sized, ctypes.byref(ev), ctypes.sizeof(ev),
                                 int(timeout_ms)), "poll"):
            return _event_dict(ev)
        return None

    def poll_previous(self):
        """What became of earlier sessions' requests (kvf_poll_previous), or None."""
        ev = _Event()
        if _check(self._call(_lib.kvf_poll_previous_sized, ctypes.byref(ev),
                                 ctypes.sizeof(ev)), "poll previous"):
            return _event_dict(ev)
        return None
