"""FastDeploy's cache messager, with kvferry moving the caches.

    python3 -m kvferry.fastdeploy <FastDeploy's cache_messager.py arguments> [--kvf-... options]

One process per tensor-parallel rank, started by FastDeploy where it starts its own messager
(docs/FASTDEPLOY.md says how to install it). It brings up (or joins) this rank's kvferry
instance with `tools/kvferry up`, publishes the caches under FastDeploy's names, sets
cache_ready_signal for its rank, starts the C bridge that turns FastDeploy's layer signals into
kvferry layer-done events (fastdeploy/bridge.h), and serves the EngineWorkerQueue: task dicts
in, [[request_id, status]] out, connect tasks answered. SIGTERM, SIGINT or the death of its
parent stops it, and with it the instance it started.
"""
import argparse
import ctypes
import errno as _errno
import json
import logging
import mmap
import os
import signal
import struct
import subprocess
import sys
import threading
import time

import kvferry

log = logging.getLogger("kvferry.fastdeploy")

# FastDeploy's statuses (put_finished_req).
FD_FINISHED = "finished"
FD_WRITE_ERROR = "write cache error"
FD_CONNECTION_ERROR = "connection error"  # V1; the older messager says "connect error"
FD_CONNECT_ERROR_OLD = "connect error"

_CONNECT_STATUSES = {"unknown peer", "connection error", "authentication failed",
                     "peer role mismatch"}

_DTYPES = {"bfloat16": "bf16", "bf16": "bf16", "float16": "fp16", "fp16": "fp16",
           "uint8": "uint8", "int8": "uint8", "fp8": "fp8", "float8_e4m3fn": "fp8",
           "int4_zp": "uint8", "block_wise_fp8": "uint8"}

RECORD_MAGIC = b"KVFHOST1"
RECORD_FMT = "<8sQQQ256s"  # magic, offset, bytes, pid of the publisher, path (NUL padded)
GPU_RECORD_BYTES = 72  # FastDeploy's: size_t nprocesses; cudaIpcMemHandle_t handle


def fd_status(kvf_status, old_names=False):
    """FastDeploy's status string for a kvferry completion status."""
    if kvf_status == "finished":
        return FD_FINISHED
    if kvf_status in _CONNECT_STATUSES:
        return FD_CONNECT_ERROR_OLD if old_names else FD_CONNECTION_ERROR
    return FD_WRITE_ERROR


# ---- arguments -----------------------------------------------------------------------------

def _shape(text):
    if text is None or str(text).strip() in ("", "None", "[]"):
        return None
    try:
        dims = [int(x) for x in str(text).strip("[]() ").split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError("a cache shape is 'blocks,heads,block_size,head_dim', "
                                         "not %r" % text)
    if len(dims) != 4 or min(dims) <= 0:
        raise argparse.ArgumentTypeError("a cache shape has 4 positive dimensions "
                                         "(blocks,heads,block_size,head_dim), not %r" % text)
    return dims


def _json(text):
    if isinstance(text, dict):
        return text
    try:
        v = json.loads(text) if text else {}
    except ValueError as e:
        raise argparse.ArgumentTypeError("--speculative_config is not JSON: %s" % e)
    return v if isinstance(v, dict) else {}


def parser():
    p = argparse.ArgumentParser(
        prog="python3 -m kvferry.fastdeploy",
        description="FastDeploy's cache messager over kvferry: FastDeploy's arguments as they "
                    "are, plus --kvf-* options.")
    a = p.add_argument
    a("--splitwise_role", default="mixed", choices=["prefill", "decode", "mixed"])
    a("--rank", type=int, default=0)
    a("--device_id", type=int, default=0)
    a("--num_layers", type=int, default=None)
    a("--num_hidden_layers", type=int, default=None, help="older name of --num_layers")
    a("--key_cache_shape", type=_shape, default=None)
    a("--value_cache_shape", type=_shape, default=None)
    a("--num_gpu_blocks", type=int, default=None)
    a("--kv_num_head", type=int, default=None)
    a("--head_dim", type=int, default=None)
    a("--block_size", type=int, default=64)
    a("--mp_num", type=int, default=1)
    a("--cache_dtype", default="bfloat16")
    a("--default_dtype", default="bfloat16")
    a("--pod_ip", default="0.0.0.0")
    a("--cache_queue_port", type=int, default=None)
    a("--engine_worker_queue_port", default="9923")
    a("--protocol", default="ipc")
    a("--local_data_parallel_id", type=int, default=0)
    a("--ipc_suffix", default=None)
    a("--engine_pid", default=None)
    a("--rdma_port", default="")
    a("--speculative_config", type=_json, default={})
    # kvferry's own
    a("--kvf-instance", default=None, help="the instance's name (default fd<suffix>-<role>-<rank>)")
    a("--kvf-backend", default=None, help="host or cuda (default: tools/kvferry up's choice)")
    a("--kvf-signal-mode", default="auto", choices=["auto", "per_chunk", "per_query"],
      help="FastDeploy's layer signals (auto: per_chunk unless FLAGS_use_pd_disaggregation=1 "
           "alone is set)")
    a("--kvf-msg-key-device-stride", type=int, default=0,
      help="per_chunk: the queue's ftok id is 1024 + rank + STRIDE * device (builds that "
           "number queues by device use 1000)")
    a("--kvf-tasks-over", default=None, choices=["tcp", "rdma"],
      help="send rdma tasks over this transport instead (a host without RDMA: tcp)")
    a("--kvf-listen", default=None, help="decode: HOST:PORT to listen at (default pod_ip:rdma_port)")
    a("--kvf-up-arg", action="append", default=[], help="another tools/kvferry up option (repeat)")
    a("--kvf-barrier-timeout", type=float, default=120.0,
      help="seconds a barrier of the ranks may take before it is broken (default 120)")
    a("--kvf-poll-us", type=int, default=50,
      help="per_query: microseconds between polls of the layer values when idle (default 50)")
    a("--kvf-queue-unix", action="store_true",
      help="the EngineWorkerQueue listens at /dev/shm/fd_task_queue_<port>.sock "
           "(default when FD_ENGINE_TASK_QUEUE_WITH_SHM=1)")
    a("--kvf-log-level", default=os.environ.get("KVFERRY_FD_LOG", "INFO"))
    return p


# Cache dtypes for which FastDeploy's cache manager allocates scale tensors beside the caches.
SCALED_DTYPES = ("block_wise_fp8",)
# Element sizes of the scale tensors' dtype (FastDeploy's default dtype, --default_dtype).
_SCALE_DTYPES = {"bfloat16": 2, "float16": 2, "float32": 4}
# ... and kvferry's name of it (`up --scale-dtype`).
_SCALE_KVF = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}


def scale_tensors(cache_dtype, layers, rank, device, key_shape, key_only, default_dtype):
    """The scale tensors FastDeploy allocates for this cache dtype: a list of
    (record name, shape, dtype, bytes), K then V per layer, in layer order; [] when none.
    Each is [blocks, kv_heads, block_size] of the default dtype, indexed by block like the
    cache it scales (block b's scales are row b)."""
    if cache_dtype not in SCALED_DTYPES:
        return []
    if default_dtype not in _SCALE_DTYPES:
        raise ValueError("--default_dtype %s: the scale tensors of %s are bfloat16, float16 or "
                         "float32" % (default_dtype, cache_dtype))
    shape = [key_shape[0], key_shape[1], key_shape[2]]
    nbytes = shape[0] * shape[1] * shape[2] * _SCALE_DTYPES[default_dtype]
    out = []
    for layer in range(layers):
        for t in (("key",) if key_only else ("key", "value")):
            out.append(("%s_cache_scales_%d_rank%d.device%d" % (t, layer, rank, device), shape,
                        default_dtype, nbytes))
    return out


class Config:
    """What the arguments mean for this rank."""

    def __init__(self, ns):
        self.ns = ns
        self.role = ns.splitwise_role
        self.rank = ns.rank
        self.nranks = ns.mp_num
        if not 0 <= self.rank < self.nranks:
            raise ValueError("--rank %d is not below --mp_num %d" % (self.rank, self.nranks))
        self.dp = ns.local_data_parallel_id
        self.rank_id = self.rank + self.dp * self.nranks
        self.device = ns.device_id
        self.suffix = ns.ipc_suffix if ns.ipc_suffix is not None else (
            ns.engine_pid if ns.engine_pid is not None else str(ns.engine_worker_queue_port))
        layers = ns.num_layers if ns.num_layers is not None else ns.num_hidden_layers
        if not layers or layers <= 0:
            raise ValueError("--num_layers (or --num_hidden_layers) is missing")
        self.layers = layers
        spec = ns.speculative_config or {}
        extra = spec.get("num_extra_cache_layer")
        if extra is None:
            extra = 1 if str(spec.get("method", "")).lower() == "mtp" else 0
        self.extra = int(extra)
        ratio = float(spec.get("num_gpu_block_expand_ratio", 1) or 1)
        if self.extra and ratio != 1:
            log.warning("speculative layers with num_gpu_block_expand_ratio %g: kvferry gives "
                        "them the model layers' block count", ratio)
        k = ns.key_cache_shape
        if k is None:
            if None in (ns.num_gpu_blocks, ns.kv_num_head, ns.head_dim):
                raise ValueError("--key_cache_shape (or --num_gpu_blocks, --kv_num_head and "
                                 "--head_dim) is missing")
            k = [ns.num_gpu_blocks, ns.kv_num_head, ns.block_size, ns.head_dim]
            self.key_only = False
        else:
            self.key_only = ns.value_cache_shape is None
            if ns.value_cache_shape is not None and ns.value_cache_shape != k:
                raise ValueError("--value_cache_shape %s differs from --key_cache_shape %s: "
                                 "kvferry needs K and V of one shape" %
                                 (ns.value_cache_shape, k))
        self.blocks, self.heads, self.block_size, self.head_dim = k
        # block_wise_fp8: a scale tensor per layer per K/V beside the uint8 caches, which the
        # instance holds as its layout's scale tensors and moves with their blocks.
        self.scales = scale_tensors(ns.cache_dtype, self.layers + self.extra, self.rank,
                                    self.device, k, self.key_only, ns.default_dtype)
        self.scale_dtype = _SCALE_KVF[ns.default_dtype] if self.scales else None
        if ns.cache_dtype not in _DTYPES:
            raise ValueError("--cache_dtype %s: kvferry takes %s" %
                             (ns.cache_dtype, ", ".join(sorted(_DTYPES))))
        self.dtype = _DTYPES[ns.cache_dtype]
        self.protocols = [x.strip() for x in ns.protocol.split(",") if x.strip()]
        for pr in self.protocols:
            if pr not in ("ipc", "rdma", "tcp"):
                raise ValueError("--protocol %s: ipc, rdma or tcp" % pr)
        ports = [x.strip() for x in str(ns.rdma_port or "").split(",") if x.strip()]
        self.rdma_port = None
        if ports:
            p = ports[self.rank] if len(ports) > 1 and self.rank < len(ports) else ports[0]
            if not p.isdigit() or not 0 < int(p) < 65536:
                raise ValueError("--rdma_port %s is not a port" % ns.rdma_port)
            self.rdma_port = int(p)
        mode = ns.kvf_signal_mode
        if mode == "auto":
            env = os.environ
            if env.get("FLAGS_use_pd_disaggregation_per_chunk") == "1" or \
                    env.get("ENABLE_V1_KVCACHE_SCHEDULER") == "1":
                mode = "per_chunk"
            elif env.get("FLAGS_use_pd_disaggregation") == "1":
                mode = "per_query"
            else:
                mode = "per_chunk"
        self.mode = mode
        self.instance = ns.kvf_instance or ("fd%s-%s-%d" % (self.suffix, self.role, self.rank_id))
        self.queue_port = int(ns.engine_worker_queue_port)
        self.queue_unix = ns.kvf_queue_unix or \
            os.environ.get("FD_ENGINE_TASK_QUEUE_WITH_SHM") == "1"


# ---- the C bridge ---------------------------------------------------------------------------

class _BridgeCfg(ctypes.Structure):
    _fields_ = [("mode", ctypes.c_int), ("rank_id", ctypes.c_uint), ("device", ctypes.c_uint),
                ("layers", ctypes.c_uint), ("msg_key", ctypes.c_int), ("poll_us", ctypes.c_uint),
                ("shm_dir", ctypes.c_char_p)]


class _BridgeStats(ctypes.Structure):
    _fields_ = [(n, ctypes.c_uint64) for n in ("signals", "steps", "layer_events", "chunks", "tasks",
                                               "bad_signals", "unknown_slots", "errors")] + \
               [("fd_step", ctypes.c_int64), ("kvf_step", ctypes.c_uint64)]


def _bridge_lib():
    d = os.path.dirname(kvferry.library_path())
    path = os.environ.get("KVFERRY_FD_LIB") or os.path.join(d, "libkvferry_fastdeploy.so.0")
    lib = ctypes.CDLL(path)
    p, u, vp = ctypes.c_void_p, ctypes.c_uint, ctypes.c_void_p
    sig = {
        "kvf_fd_bridge_start": (ctypes.c_int, [p, ctypes.POINTER(_BridgeCfg), ctypes.POINTER(vp),
                                               ctypes.c_char_p, ctypes.c_size_t]),
        "kvf_fd_bridge_stop": (None, [p]),
        "kvf_fd_bridge_step_of": (ctypes.c_int64, [p, ctypes.c_int64]),
        "kvf_fd_bridge_submit_slot": (ctypes.c_int, [p, u, ctypes.c_char_p, ctypes.c_uint64,
                                                     ctypes.c_char_p, ctypes.c_size_t,
                                                     ctypes.c_size_t]),
        "kvf_fd_bridge_release_slot": (ctypes.c_int, [p, u, ctypes.c_char_p]),
        "kvf_fd_bridge_get_stats": (None, [p, ctypes.POINTER(_BridgeStats)]),
        "kvf_fd_bridge_error": (None, [p, ctypes.c_char_p, ctypes.c_size_t]),
    }
    for n, (r, args) in sig.items():
        f = getattr(lib, n)
        f.restype, f.argtypes = r, args
    return lib


def msg_key(rank_id, device, stride=0):
    """FastDeploy's per_chunk queue key: ftok("/opt/", 1024 + rank [+ stride * device])."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.ftok.restype, libc.ftok.argtypes = ctypes.c_int, [ctypes.c_char_p, ctypes.c_int]
    k = libc.ftok(b"/opt/", 1024 + rank_id + stride * device)
    if k == -1:
        e = ctypes.get_errno()
        raise OSError(e, "ftok(/opt/): %s (FastDeploy's per_chunk queue needs /opt to exist)"
                      % os.strerror(e))
    return k


class Bridge:
    def __init__(self, client, cfg):
        self.lib = _bridge_lib()
        c = _BridgeCfg(mode=1 if cfg.mode == "per_query" else 2, rank_id=cfg.rank_id,
                       device=cfg.device, layers=cfg.layers + cfg.extra,
                       msg_key=msg_key(cfg.rank_id, cfg.device, cfg.ns.kvf_msg_key_device_stride)
                       if cfg.mode == "per_chunk" else 0, poll_us=max(1, cfg.ns.kvf_poll_us),
                       shm_dir=None)
        self.h = ctypes.c_void_p()
        err = ctypes.create_string_buffer(512)
        rc = self.lib.kvf_fd_bridge_start(client._h, ctypes.byref(c), ctypes.byref(self.h), err, 512)
        if rc < 0:
            raise OSError(-rc, "fastdeploy bridge: %s" % err.value.decode(errors="replace"))
        self._err_seen = ""
        self._lk = threading.Lock()  # no call into the bridge while (or after) it stops

    def _h(self):
        if not self.h:
            raise OSError(_errno.EBADF, "fastdeploy bridge: stopped")
        return self.h

    def stop(self):
        with self._lk:
            if self.h:
                self.lib.kvf_fd_bridge_stop(self.h)
                self.h = None

    def step_of(self, fd_step):
        with self._lk:
            return int(self.lib.kvf_fd_bridge_step_of(self._h(), int(fd_step)))

    def submit_slot(self, slot, rid, need, packed, off):
        with self._lk:
            return self.lib.kvf_fd_bridge_submit_slot(self._h(), slot, rid.encode(), need, packed,
                                                      len(packed), off)

    def release_slot(self, slot, rid):
        with self._lk:
            if not self.h:
                return -_errno.EBADF
            return self.lib.kvf_fd_bridge_release_slot(self.h, slot, rid.encode())

    def stats(self):
        s = _BridgeStats()
        with self._lk:
            self.lib.kvf_fd_bridge_get_stats(self._h(), ctypes.byref(s))
        return {n: int(getattr(s, n)) for n, _ in _BridgeStats._fields_}

    def new_error(self):
        b = ctypes.create_string_buffer(400)
        with self._lk:
            if not self.h:
                return None
            self.lib.kvf_fd_bridge_error(self.h, b, 400)
        e = b.value.decode(errors="replace")
        if e and e != self._err_seen:
            self._err_seen = e
            return e
        return None


def pack_with_step(task):
    """msgpack of `task` with current_id first, as a uint64 placeholder: (bytes, its offset)."""
    import msgpack
    body = msgpack.packb(task, use_bin_type=True)
    n = len(task) + 1
    # strip the map header msgpack wrote for len(task) entries
    h = 1 if len(task) < 16 else (3 if len(task) < 65536 else 5)
    head = bytes([0x80 | n]) if n < 16 else (b"\xde" + struct.pack(">H", n))
    key = msgpack.packb("current_id")
    packed = head + key + b"\xcf" + b"\0" * 8 + body[h:]
    return packed, len(head) + len(key)


# ---- caches in FastDeploy's format ------------------------------------------------------------

def _mapping_of(addr):
    """(path, offset in the file) of the mapping holding addr in this process."""
    with open("/proc/self/maps") as f:
        for line in f:
            parts = line.split(None, 5)
            lo, hi = (int(x, 16) for x in parts[0].split("-"))
            if lo <= addr < hi and len(parts) == 6:
                return parts[5].strip().replace(" (deleted)", ""), int(parts[2], 16) + addr - lo
    return None, None


def record_names(cfg):
    """FastDeploy's names of this rank's tensors, as (name, layer, v, scale): every layer's K
    (and V), then their scale tensors when the cache dtype has them (".<FD_IPC_APPEND_SUFFIX>"
    after each when that is set, as FastDeploy does for two instances on one GPU)."""
    sfx = os.environ.get("FD_IPC_APPEND_SUFFIX", "")
    sfx = "." + sfx if sfx and "/" not in sfx else ""
    names = []
    for scale in ((False, True) if cfg.scales else (False,)):
        kind = "cache_scales" if scale else "caches"
        for layer in range(cfg.layers + cfg.extra):
            for v, t in enumerate(("key",) if cfg.key_only else ("key", "value")):
                names.append(("%s_%s_%d_rank%d.device%d%s" % (t, kind, layer, cfg.rank, cfg.device,
                                                              sfx), layer, v, scale))
    return names


def publish_records(client, cfg, shm_dir="/dev/shm"):
    """FastDeploy's per-tensor records. Host caches: kvferry's own record (RECORD_FMT: a magic, a
    file and an offset) under FastDeploy's name; each replaces a stale one atomically."""
    if client.device is not None:
        # GPU caches: the allocator made one allocation per tensor and published FastDeploy's
        # own records (kvf-allocator --fastdeploy); they must all be there.
        for name, _, _, _ in record_names(cfg):
            p = os.path.join(shm_dir, name)
            try:
                size = os.stat(p).st_size
            except OSError:
                size = -1
            if size != GPU_RECORD_BYTES:
                raise OSError(_errno.ENOENT, "%s: %s; the instance %s was not started with "
                              "`tools/kvferry up --fastdeploy` (one allocation per tensor), or "
                              "--device/--rank differ from FastDeploy's" %
                              (p, "missing" if size < 0 else "%d bytes, not FastDeploy's 72" % size,
                               cfg.instance))
        return []
    done = []
    for name, layer, v, scale in record_names(cfg):
        t = client.scale_tensor(layer, v) if scale else client.tensor(layer, v)
        addr = ctypes.addressof(ctypes.c_char.from_buffer(t))
        path, off = _mapping_of(addr)
        if not path or not path.startswith("/"):
            raise OSError(_errno.ENOENT, "cannot find the file behind %s" % name)
        rec = struct.pack(RECORD_FMT, RECORD_MAGIC, off, len(t), os.getpid(), path.encode())
        tmp = os.path.join(shm_dir, ".%s.%d" % (name, os.getpid()))
        with open(tmp, "wb") as f:
            f.write(rec)
        os.chmod(tmp, 0o600)
        os.rename(tmp, os.path.join(shm_dir, name))  # replaces a record a crashed run left
        done.append(name)
        del t
    return done


def remove_records(names, shm_dir="/dev/shm"):
    for n in names:
        try:
            with open(os.path.join(shm_dir, n), "rb") as f:
                rec = f.read()
            # only ours: a record of a newer messager stays
            if len(rec) == struct.calcsize(RECORD_FMT) and \
                    struct.unpack(RECORD_FMT, rec)[3] == os.getpid():
                os.unlink(os.path.join(shm_dir, n))
        except OSError:
            pass


class IntArraySignal:
    """FastDeploy's IPCSignal of int32s: /dev/shm/<name>.<suffix>."""

    def __init__(self, name, suffix, n, create=False, shm_dir="/dev/shm"):
        self.path = os.path.join(shm_dir, "%s.%s" % (name, suffix))
        flags = os.O_RDWR | (os.O_CREAT if create else 0)
        fd = os.open(self.path, flags, 0o666)
        try:
            if os.fstat(fd).st_size < 4 * n:
                os.ftruncate(fd, 4 * n)
            self.m = mmap.mmap(fd, 4 * n)
        finally:
            os.close(fd)
        self.n = n
        # Each value in one aligned store, as FastDeploy's own writes: struct.pack_into clears
        # its bytes before it writes them, and a reader in between sees 0.
        self.v = memoryview(self.m).cast("i")

    def __getitem__(self, i):
        return self.v[i]

    def __setitem__(self, i, v):
        self.v[i] = v


# ---- the EngineWorkerQueue, client side -------------------------------------------------------

_QUEUE_IDS = (
    "get_tasks", "get_client_read_flag", "get_lock", "get_read_finish_flag",
    "get_exist_tasks_inter_signal", "get_connected_client_counter", "get_finish_request_queue",
    "get_finish_add_cache_task_queue", "get_cache_infos", "get_client_read_info_flag",
    "get_lock_info", "get_disaggregate_requests", "get_finish_request_barrier",
    "get_finish_add_cache_task_barrier", "get_connect_task_barrier",
    "get_connect_task_response_barrier", "get_finish_send_cache_barrier",
    "get_begin_send_cache_barrier", "get_cache_info_barrier", "get_connect_rdma_tasks",
    "get_client_get_connect_task_flag", "get_client_get_connect_task_response_flag",
    "get_client_get_finished_add_cache_task_flag_init",
    "get_client_get_finish_send_cache_flag_init", "get_connect_rdma_tasks_responses",
    "get_connect_task_lock", "get_connect_task_response_lock", "get_finish_add_cache_task_lock",
    "get_finish_send_cache_lock", "get_worker_process_tp_barrier",
    "get_can_put_next_connect_task_response_flag", "get_can_put_next_add_task_finished_flag",
    "get_can_put_next_send_cache_finished_flag")


class QueueClient:
    """One messager rank's side of FastDeploy's EngineWorkerQueue (its type ids, its authkey,
    its flags and locks). Every call is one rank's part of a protocol all ranks follow."""

    def __init__(self, address, nranks, rank, dp=0, authkey=b"secret_key", tries=20,
                 interval=0.5):
        from multiprocessing.managers import BaseManager

        class _M(BaseManager):
            pass

        for n in _QUEUE_IDS:
            _M.register(n)
        self.address, self.n, self.me, self.dp = address, nranks, rank, dp
        # Proxies keep one connection per thread and server address: those of a server that
        # went away are dead, and the next proxies must not inherit them.
        from multiprocessing.managers import BaseProxy
        BaseProxy._address_to_local.pop(address, None)
        self.m = _M(address=address, authkey=authkey)
        last = None
        for _ in range(tries):
            try:
                self.m.connect()
                break
            except (ConnectionError, FileNotFoundError, OSError) as e:
                last = e
                time.sleep(interval)
        else:
            raise ConnectionError("EngineWorkerQueue at %r: %s" % (address, last or "no answer"))
        g = lambda n: getattr(self.m, n)(dp)  # noqa: E731
        self.lock_info, self.cache_infos = g("get_lock_info"), g("get_cache_infos")
        self.read_info = g("get_client_read_info_flag")
        self.cache_info_barrier = g("get_cache_info_barrier")
        self.finish_send_barrier = g("get_finish_send_cache_barrier")
        self.finish_request_barrier = g("get_finish_request_barrier")
        self.begin_send_barrier = g("get_begin_send_cache_barrier")
        self.finish_add_barrier = g("get_finish_add_cache_task_barrier")
        self.send_lock, self.finished = g("get_finish_send_cache_lock"), g("get_finish_request_queue")
        self.send_flags = g("get_client_get_finish_send_cache_flag_init")
        self.can_put_send = g("get_can_put_next_send_cache_finished_flag")
        self.add_lock, self.added = g("get_finish_add_cache_task_lock"), g("get_finish_add_cache_task_queue")
        self.add_flags = g("get_client_get_finished_add_cache_task_flag_init")
        self.can_put_add = g("get_can_put_next_add_task_finished_flag")
        self.conn_lock, self.conn_tasks = g("get_connect_task_lock"), g("get_connect_rdma_tasks")
        self.conn_flags = g("get_client_get_connect_task_flag")
        self.conn_barrier = g("get_connect_task_barrier")
        self.resp_lock, self.responses = g("get_connect_task_response_lock"), g("get_connect_rdma_tasks_responses")
        self.resp_flags = g("get_client_get_connect_task_response_flag")
        self.can_put_resp = g("get_can_put_next_connect_task_response_flag")
        self.resp_barrier = g("get_connect_task_response_barrier")
        lock, counter = g("get_lock"), g("get_connected_client_counter")
        with _held(lock):
            counter.set(counter.get() + 1)

    def get_cache_info(self):
        """This rank's copy of the task dicts the engine put (each rank reads each list once)."""
        with _held(self.lock_info):
            if self.read_info[self.me] == 1:
                return []
            infos = self.cache_infos[:]
            self.read_info[self.me] = 1
            if sum(self.read_info[:]) == self.n:
                self.cache_infos[:] = []
        return infos

    def _put_one(self, lock, can_put, out, flags, item):
        """One rank's answer: waits until the engine took the previous round."""
        while True:
            with _held(lock):
                if can_put.get():
                    out.append(item)
                    flags[self.me] = 1
                    if sum(flags[:]) == self.n:
                        can_put.set(0)
                    return
            time.sleep(0.001)

    def put_finished_req(self, results):
        self._put_one(self.send_lock, self.can_put_send, self.finished, self.send_flags,
                      list(results[0]))

    def put_finished_add_cache_task_req(self, ids):
        self._put_one(self.add_lock, self.can_put_add, self.added, self.add_flags, list(ids))

    def get_connect_rdma_task(self):
        with _held(self.conn_lock):
            task = self.conn_tasks[0] if len(self.conn_tasks) else None
            self.conn_flags[self.me] = 1
            everyone = sum(self.conn_flags[:]) == self.n
            if everyone:
                self.conn_tasks[:] = []
        return task, everyone

    def put_connect_rdma_task_response(self, resp):
        self._put_one(self.resp_lock, self.can_put_resp, self.responses, self.resp_flags, resp)


class _held:
    """A lock proxy held for a block (the queue's proxies expose acquire/release only)."""

    def __init__(self, lock):
        self.lock = lock

    def __enter__(self):
        self.lock.acquire()

    def __exit__(self, *exc):
        self.lock.release()


QUEUE_ERRORS = (EOFError, ConnectionError, OSError)


def wait_barrier(b, timeout, what):
    """A barrier of every rank's messager; a timeout breaks it for all (no rank hangs)."""
    import threading as _t
    try:
        b.wait(timeout)
        return True
    except _t.BrokenBarrierError:
        log.error("barrier %s broken (a rank did not come within %.0f s): going on", what, timeout)
        try:
            b.reset()
        except Exception:
            pass
        return False


# ---- the order every rank reports in -----------------------------------------------------------

class OrderLog:
    """The order in which the ranks of one engine report their requests: rank 0 appends each
    request id when it reports it, the other ranks read and follow (FastDeploy's engine takes one
    request per round from every rank, so all must report the same one). A file in /dev/shm of
    ORDER_SLOTS entries, written by rank 0 only: an entry is its bytes, then its index; the count
    last; readers check the index and a CRC, so a torn entry is read again, never used."""

    MAGIC = b"KVFORD01"
    HEAD = 64
    SLOTS = 16384
    ENTRY = 160  # u64 index + 1, u32 length, u32 crc32, the id (at most 144 bytes)

    def __init__(self, suffix, dp, leader, shm_dir="/dev/shm"):
        self.path = os.path.join(shm_dir, "kvferry-fd-order.%s.dp%d" % (suffix, dp))
        self.leader = leader
        self.m = None
        self.epoch = None
        self.next = 0
        if leader:
            import random
            size = self.HEAD + self.SLOTS * self.ENTRY
            tmp = "%s.%d" % (self.path, os.getpid())
            with open(tmp, "wb") as f:
                f.truncate(size)
                f.write(self.MAGIC + struct.pack("<QQQ", random.getrandbits(63) | 1, 0, os.getpid()))
            os.rename(tmp, self.path)  # a follower sees the old log or the new, whole
            self._ino = os.stat(self.path).st_ino
            self._open()

    def _open(self):
        try:
            fd = os.open(self.path, os.O_RDWR if self.leader else os.O_RDONLY)
        except OSError:
            return False
        try:
            size = os.fstat(fd).st_size
            if size < self.HEAD + self.SLOTS * self.ENTRY:
                return False
            prot = mmap.PROT_READ | (mmap.PROT_WRITE if self.leader else 0)
            m = mmap.mmap(fd, size, mmap.MAP_SHARED, prot)
        finally:
            os.close(fd)
        if m[:8] != self.MAGIC:
            return False
        if not self.leader:
            # a log whose writer is gone (a crashed run's) is no log
            try:
                os.kill(struct.unpack_from("<Q", m, 24)[0], 0)
            except (OSError, OverflowError):
                return False
        self.m = m
        self.epoch = struct.unpack_from("<Q", m, 8)[0]
        self.next = struct.unpack_from("<Q", m, 16)[0] if self.leader else 0
        return True

    def append(self, rid):
        import zlib
        b = rid.encode()[:144]
        i = self.next
        off = self.HEAD + (i % self.SLOTS) * self.ENTRY
        self.m[off + 16:off + 16 + len(b)] = b
        struct.pack_into("<II", self.m, off + 8, len(b), zlib.crc32(b))
        struct.pack_into("<Q", self.m, off, i + 1)
        struct.pack_into("<Q", self.m, 16, i + 1)
        self.next = i + 1

    def read(self):
        """The next request id rank 0 reported, or None (not yet, or no log yet)."""
        import zlib
        if self.m is None and not self._open():
            return None
        if self.m[:8] != self.MAGIC:
            return None
        # rank 0 started again (looked at once a second): its new log counts from 0 (the old
        # file stays mapped here until then)
        fresh = False
        now = time.monotonic()
        if now - getattr(self, "_looked", 0) > 1:
            self._looked = now
            try:
                st = os.stat(self.path)
                fresh = st.st_ino != getattr(self, "_ino", st.st_ino)
                self._ino = st.st_ino
            except OSError:
                pass
        if fresh:
            self.m = None
            if not self._open():
                return None
            log.warning("rank 0's report order started again: following the new one")
        count = struct.unpack_from("<Q", self.m, 16)[0]
        if count <= self.next:
            return None
        if count - self.next > self.SLOTS:
            log.error("%d reports behind rank 0: skipping to its last %d", count - self.next, self.SLOTS)
            self.next = count - self.SLOTS
        off = self.HEAD + (self.next % self.SLOTS) * self.ENTRY
        idx = struct.unpack_from("<Q", self.m, off)[0]
        n, crc = struct.unpack_from("<II", self.m, off + 8)
        b = bytes(self.m[off + 16:off + 16 + min(n, 144)])
        if idx != self.next + 1 or zlib.crc32(b) != crc:
            return None  # being written: read it again later
        self.next += 1
        return b.decode(errors="replace")

    def close(self):
        """Rank 0: the log goes (when it is still its own)."""
        try:
            if self.leader and os.stat(self.path).st_ino == self._ino:
                os.unlink(self.path)
        except OSError:
            pass
        self.m = None


# ---- the messager ---------------------------------------------------------------------------

class Messager:
    def __init__(self, cfg):
        self.cfg = cfg
        self.stopping = threading.Event()
        self.lost = threading.Event()  # the queue went away: its threads end, run() reconnects
        self.started_instance = False
        self.records = []
        self.client = None
        self.bridge = None
        self.queue = None
        self.ready = None
        self.lock = threading.Lock()
        self.halves = {}      # request_id -> the half that came first
        self.order = []       # request ids moving (submitted, or failed and not yet reported)
        self.done = []        # request ids whose status is known here, in that order
        self.orderlog = None  # the order every rank reports in (OrderLog)
        self.cur = None       # the request being reported (kept across a queue reconnect)
        self.status = {}      # request_id -> kvferry status, once known here
        self.slot_of = {}     # request_id -> batch slot (per_chunk)
        self.connects = {}    # task_id -> connect result
        self.cv = threading.Condition(self.lock)
        self.old_names = cfg.mode == "per_query"

    # -- the instance --

    def up_args(self):
        c = self.cfg
        a = ["--instance", c.instance, "--role", c.role, "--fastdeploy", "--layers", str(c.layers),
             "--kv-heads", str(c.heads), "--head-dim", str(c.head_dim), "--dtype", c.dtype,
             "--blocks", str(c.blocks), "--block-size", str(c.block_size),
             "--rank", str(c.rank), "--nranks", str(c.nranks), "--device", str(c.device)]
        if c.extra:
            a += ["--extra-layers", str(c.extra)]
        if c.key_only:
            a.append("--key-only")
        if c.scale_dtype:
            a += ["--scale-dtype", c.scale_dtype]
        if c.ns.kvf_backend:
            a += ["--backend", c.ns.kvf_backend]
        if c.role in ("decode", "mixed"):
            listen = c.ns.kvf_listen
            if not listen and c.rdma_port:
                host = c.ns.pod_ip if c.ns.pod_ip not in ("", "0.0.0.0") else "127.0.0.1"
                listen = "%s:%d" % (host, c.rdma_port)
            if listen:
                a += ["--listen", listen]
        for extra in c.ns.kvf_up_arg:
            a += extra.split()
        return a

    def bring_up(self):
        try:
            self.client = kvferry.Client(self.cfg.instance, wait_ms=100)
            log.info("joined the running instance %s", self.cfg.instance)
            self.check_gpu_gate()
            return
        except kvferry.KvferryError:
            pass
        root = os.path.normpath(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
        tool = os.environ.get("KVFERRY_TOOL") or os.path.join(root, "tools", "kvferry")
        cmd = [tool, "up"] + self.up_args()
        log.info("starting: %s", " ".join(cmd))
        r = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        if r.returncode != 0:
            raise RuntimeError("tools/kvferry up failed (%d): %s" % (r.returncode, r.stdout.strip()))
        self.started_instance = True
        self.client = kvferry.Client(self.cfg.instance, wait_ms=5000)

    def bring_down(self):
        if self.started_instance:
            root = os.path.normpath(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
            tool = os.environ.get("KVFERRY_TOOL") or os.path.join(root, "tools", "kvferry")
            subprocess.run([tool, "down", "--instance", self.cfg.instance],
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    # -- tasks --

    def _fail_now(self, rid, status, why):
        log.error("request %s: %s (%s)", rid, status, why)
        with self.cv:
            if rid not in self.status:
                self.order.append(rid)
                self.status[rid] = ("fd", status)
                self.done.append(rid)
                self.cv.notify_all()

    def take_infos(self, infos):
        added = []
        for info in infos:
            if not isinstance(info, dict) or not isinstance(info.get("request_id"), (str, bytes)):
                log.error("refused a task that is not a dict with a request_id: %r", info)
                continue
            rid = info["request_id"]
            if isinstance(rid, bytes):
                rid = rid.decode(errors="replace")
            if "error_msg" in info:
                self.halves.pop(rid, None)
                self._release(rid)
                self._fail_now(rid, FD_WRITE_ERROR, "decode side: %s" % info["error_msg"])
                continue
            with self.cv:
                moving = rid in self.order
            if moving:
                log.error("request %s is still moving: a second task of that id is dropped", rid)
                continue
            if "src_block_ids" in info and "dest_block_ids" not in info:
                added.append(rid)
            first = self.halves.pop(rid, None)
            if first is None and not ("src_block_ids" in info and "dest_block_ids" in info):
                self.halves[rid] = dict(info)
                continue
            task = dict(first or {})
            task.update(info)
            try:
                self.submit(rid, task)
            except (ValueError, TypeError, KeyError) as e:
                self._fail_now(rid, FD_WRITE_ERROR, "bad task: %s" % e)
            except OSError as e:
                self._fail_now(rid, FD_WRITE_ERROR, str(e))
        return added

    def submit(self, rid, t):
        src = [int(x) for x in t["src_block_ids"]]
        dest = [int(x) for x in t["dest_block_ids"]]
        held = 0
        while held < len(dest) and dest[held] == -1:
            held += 1
        if any(x < 0 for x in dest[held:]) or any(x < 0 for x in src):
            raise ValueError("negative block ids other than decode's leading -1s")
        dest = dest[held:]
        if len(dest) > len(src):
            raise ValueError("%d destination blocks for %d source blocks" % (len(dest), len(src)))
        proto = str(t.get("transfer_protocol", "ipc"))
        if proto == "rdma" and self.cfg.ns.kvf_tasks_over:
            proto = self.cfg.ns.kvf_tasks_over
        rec = {"request_id": rid, "src_block_ids": src, "dest_block_ids": dest,
               "transfer_protocol": proto}
        for k in ("ip", "device_ids"):
            if t.get(k) is not None:
                rec[k] = t[k] if k == "ip" else [int(x) for x in t[k]]
        ports = t.get("rdma_ports")
        if ports is not None:
            rec["rdma_ports"] = [int(x) for x in (ports if isinstance(ports, (list, tuple)) else [ports])]
        if "peer" in t:
            rec["peer"] = str(t["peer"])
        cur = int(t["current_id"])
        if self.cfg.mode == "per_chunk":
            if not 0 <= cur < 512:
                raise ValueError("current_id %d is not a batch slot (0..511)" % cur)
            need = int(t.get("need_prefill_tokens") or len(src) * self.cfg.block_size)
            rec["chunked"] = True
            packed, off = pack_with_step(rec)
        else:
            rec["current_id"] = self.bridge.step_of(cur % 100003) if self.bridge else cur
        # In the report order before kvferry can answer; out of it again if kvferry never got it.
        with self.cv:
            self.order.append(rid)
            if self.cfg.mode == "per_chunk":
                self.slot_of[rid] = cur
        try:
            if self.cfg.mode == "per_chunk":
                rc = self.bridge.submit_slot(cur, rid, need, packed, off)
                if rc < 0:
                    raise OSError(-rc, "slot %d: %s" % (cur, "another request still holds it"
                                                        if rc == -_errno.EBUSY else os.strerror(-rc)))
            else:
                self.client.submit_task(rec)
        except BaseException:
            with self.cv:
                self.slot_of.pop(rid, None)
                self.order.remove(rid)
            raise

    def _release(self, rid):
        with self.cv:
            slot = self.slot_of.pop(rid, None)
        if slot is not None and self.bridge:
            self.bridge.release_slot(slot, rid)

    # -- threads --

    def serving(self):
        return not self.stopping.is_set() and not self.lost.is_set()

    def info_loop(self):
        while self.serving():
            try:
                infos = self.queue.get_cache_info()
                if not infos:
                    time.sleep(0.001)
                    continue
                wait_barrier(self.queue.cache_info_barrier, self.cfg.ns.kvf_barrier_timeout,
                             "cache_info")
                added = self.take_infos(infos)
                if added and self.cfg.mode == "per_chunk":
                    wait_barrier(self.queue.finish_add_barrier, self.cfg.ns.kvf_barrier_timeout,
                                 "finish_add_cache_task")
                    self.queue.put_finished_add_cache_task_req(added)
            except QUEUE_ERRORS as e:
                self.queue_gone(e)
                return

    def event_loop(self):
        while not self.stopping.is_set():
            try:
                ev = self.client.poll(timeout_ms=200)
            except kvferry.KvferryError as e:
                if self.stopping.is_set():
                    return
                log.error("poll: %s", e)
                time.sleep(0.2)
                continue
            if ev is None:
                self.report_bridge()
                continue
            if ev["type"] == "completion":
                rid = ev["request_id"]
                if ev["status"] != "finished":
                    log.warning("request %s: %s (%s)", rid, ev["status"], ev["reason"])
                self._release(rid)
                with self.cv:
                    if rid in self.order and rid not in self.status:
                        self.done.append(rid)
                    self.status[rid] = ("kvf", ev["status"])
                    self.cv.notify_all()
            elif ev["type"] == "connect result":
                with self.cv:
                    self.connects[ev["request_id"] or ev.get("task_id", "")] = ev
                    self.cv.notify_all()
            elif ev["type"] == "arrival" and ev["status"] != "finished":
                log.warning("arrival of %s: %s (%s)", ev["request_id"], ev["status"], ev["reason"])

    def report_bridge(self):
        if self.bridge:
            e = self.bridge.new_error()
            if e:
                log.error("layer signals: %s", e)

    def next_to_report(self):
        """Rank 0: the first request whose status it knows. The others: the next one rank 0
        reported, once its status is known here (a request this rank never had, after 10 s:
        "write cache error", so that no rank waits for ever)."""
        with self.cv:
            if self.cur is None:
                if self.cfg.rank == 0:
                    if self.done:
                        self.cur = self.done[0]
                        self.orderlog.append(self.cur)
                else:
                    self.cur = self.orderlog.read()
                    self.cur_since = time.monotonic()
            if self.cur is None:
                return None
            rid = self.cur
            if rid in self.status:
                return rid
            if rid not in self.order and time.monotonic() - self.cur_since > 10:
                log.error("rank 0 reported request %s, which this rank never had", rid)
                self.order.append(rid)
                self.status[rid] = ("fd", FD_WRITE_ERROR)
                return rid
            return None

    def report_loop(self):
        """Statuses to the engine, every rank the same request at a time (OrderLog)."""
        while self.serving():
            rid = self.next_to_report()
            if rid is None:
                with self.cv:
                    self.cv.wait(0.0005 if self.cfg.rank else 0.2)
                continue
            with self.cv:
                kind, st = self.status[rid]
            fd = st if kind == "fd" else fd_status(st, self.old_names)
            try:
                wait_barrier(self.queue.finish_send_barrier, self.cfg.ns.kvf_barrier_timeout,
                             "finish_send_cache")
                self.queue.put_finished_req([[rid, fd]])
            except QUEUE_ERRORS as e:
                self.queue_gone(e)  # the status stays, for the queue that comes back
                return
            with self.cv:
                self.cur = None
                self.status.pop(rid, None)
                if rid in self.order:
                    self.order.remove(rid)
                if rid in self.done:
                    self.done.remove(rid)
            (log.debug if fd == FD_FINISHED else log.warning)("request %s: %s", rid, fd)

    def connect_loop(self):
        last = None
        while self.serving():
            try:
                task, _ = self.queue.get_connect_rdma_task()
            except QUEUE_ERRORS as e:
                self.queue_gone(e)
                return
            if task is None or (isinstance(task, dict) and task.get("task_id") == last):
                time.sleep(0.001)
                continue
            ok = False
            tid = str(task.get("task_id", "")) if isinstance(task, dict) else ""
            last = task.get("task_id") if isinstance(task, dict) else None
            try:
                wait_barrier(self.queue.conn_barrier, self.cfg.ns.kvf_barrier_timeout, "connect_task")
                ok = self.connect(task)
            except QUEUE_ERRORS as e:
                self.queue_gone(e)
                return
            except (ValueError, TypeError, KeyError, AttributeError) as e:
                log.error("connect task %r: %s", task, e)
            try:
                self.queue.put_connect_rdma_task_response({"task_id": last, "success": ok})
                wait_barrier(self.queue.resp_barrier, self.cfg.ns.kvf_barrier_timeout,
                             "connect_task_response")
            except QUEUE_ERRORS as e:
                self.queue_gone(e)
                return
            log.info("connect task %s: %s", tid, "connected" if ok else "failed")

    def connect(self, task):
        tid = "fd-connect-%s" % task["task_id"]
        ports = task.get("rdma_ports", task.get("rdma_port"))
        if isinstance(ports, (list, tuple)):
            ports = ports[self.cfg.rank] if len(ports) > self.cfg.rank else ports[0]
        peer = "%s:%d" % (task["ip"], int(ports))
        proto = self.cfg.ns.kvf_tasks_over or None
        self.client.connect(tid, peer, proto)
        end = time.monotonic() + 30
        with self.cv:
            while tid not in self.connects and time.monotonic() < end and not self.stopping.is_set():
                self.cv.wait(0.2)
            ev = self.connects.pop(tid, None)
        if ev is None or ev["status"] != "finished":
            log.error("connect to %s: %s", peer, ev and ("%s (%s)" % (ev["status"], ev["reason"])))
            return False
        return True

    def queue_gone(self, e):
        if self.serving():
            log.error("the EngineWorkerQueue went away (%s: %s): connecting again until it is "
                      "back; statuses wait for it", type(e).__name__, e)
            self.lost.set()

    # -- life --

    def run(self):
        c = self.cfg
        log.info("%s rank %d/%d (dp %d) device %d: %d+%d layers, %d blocks of %dx%dx%d %s, "
                 "signals %s, instance %s", c.role, c.rank, c.nranks, c.dp, c.device, c.layers,
                 c.extra, c.blocks, c.heads, c.block_size, c.head_dim, c.dtype, c.mode, c.instance)
        self.bring_up()
        # FastDeploy's worker attaches only through these records: without them it waits on
        # cache_ready_signal for ever, so a failure here ends the messager, said loudly.
        self.records = publish_records(self.client, c)
        if self.client.device is not None:
            log.info("GPU %d caches: FastDeploy's records published by the allocator",
                     self.client.device)
        if c.role in ("prefill", "mixed"):
            self.bridge = Bridge(self.client, c)
        try:
            self.ready = IntArraySignal("cache_ready_signal", c.suffix, c.nranks)
            self.ready[c.rank] = 1
        except OSError as e:
            log.warning("cache_ready_signal.%s: %s (the engine creates it)", c.suffix, e)
        addr = "/dev/shm/fd_task_queue_%d.sock" % c.queue_port if c.queue_unix else \
            (c.ns.pod_ip, c.queue_port)
        if c.role in ("prefill", "mixed"):
            self.orderlog = OrderLog(c.suffix, c.dp, c.rank == 0)
        threading.Thread(target=self.event_loop, name="events", daemon=True).start()
        parent = os.getppid()
        said = 0.0
        while not self.stopping.is_set():
            try:
                self.queue = QueueClient(addr, c.nranks, c.rank, c.dp, tries=1)
            except QUEUE_ERRORS as e:
                if time.monotonic() - said > 10:
                    log.error("%s; trying again every second", e if "EngineWorkerQueue" in str(e)
                              else "EngineWorkerQueue at %r: %s: %s" % (addr, type(e).__name__, e))
                    said = time.monotonic()
                if self.stopping.wait(1.0) or os.getppid() != parent:
                    break
                continue
            self.lost.clear()
            threads = []
            if c.role in ("prefill", "mixed"):
                for f in (self.info_loop, self.report_loop, self.connect_loop):
                    threads.append(threading.Thread(target=f, name=f.__name__, daemon=True))
                    threads[-1].start()
            log.info("ready: serving the EngineWorkerQueue at %r", addr)
            while not self.stopping.wait(0.2) and not self.lost.is_set():
                if os.getppid() != parent:
                    log.info("the engine is gone: stopping")
                    self.stopping.set()
            for t in threads:
                t.join(5)

    def close(self):
        self.stopping.set()
        if self.ready is not None:
            try:
                self.ready[self.cfg.rank] = 0
            except (ValueError, OSError):
                pass
        remove_records(self.records)
        if self.orderlog:
            self.orderlog.close()
        if self.bridge:
            try:
                log.info("layer signals: %s", " ".join("%s %d" % kv for kv in self.bridge.stats().items()))
            except OSError:
                pass
            self.bridge.stop()
            self.bridge = None
        if self.client:
            self.client.close()
        self.bring_down()


def main(argv=None):
    import shlex
    argv = list(sys.argv[1:] if argv is None else argv)
    # kvferry's options for a messager FastDeploy starts with its own argv
    argv += shlex.split(os.environ.get("KVFERRY_FD_ARGS", ""))
    ns, rest = parser().parse_known_args(argv)
    logging.basicConfig(level=getattr(logging, str(ns.kvf_log_level).upper(), logging.INFO),
                        format="%(asctime)s kvferry.fastdeploy[%(process)d] %(levelname)s %(message)s")
    if rest:
        log.warning("arguments kvferry does not use: %s", " ".join(rest))
    try:
        cfg = Config(ns)
    except ValueError as e:
        print("kvferry.fastdeploy: %s" % e, file=sys.stderr)
        return 2
    try:
        libc = ctypes.CDLL(None)
        libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG: the engine's death stops us
    except (OSError, AttributeError):
        pass
    m = Messager(cfg)

    def stop(sig, _frame):
        log.info("signal %d: stopping", sig)
        m.stopping.set()

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    rc = 0
    try:
        m.run()
    except (RuntimeError, OSError, ConnectionError) as e:
        log.error("%s", e)
        rc = 1
    finally:
        m.close()
    return rc


if __name__ == "__main__":
    sys.exit(main())
