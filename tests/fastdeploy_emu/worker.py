"""An emulated FastDeploy model worker: attaches the caches a messager published, the way
FastDeploy's worker does (open each tensor's POSIX shared-memory record by FastDeploy's name,
map what it names, use the pointer with no offset), and raises the layer signals of either
mode (per_query: two int32 shm values; per_chunk: a System V message queue)."""
import ctypes
import mmap
import os
import struct

RECORD_MAGIC = b"KVFHOST1"
RECORD_FMT = "<8sQQQ256s"
GPU_RECORD_BYTES = 72  # FastDeploy's { size_t nprocesses; cudaIpcMemHandle_t handle; }
STEP_MODULO = 100003


class AttachError(Exception):
    pass


def attach_tensor(name, shm_dir="/dev/shm"):
    """The tensor named `name` (key_caches_{layer}_rank{rank}.device{device}): a writable
    memoryview of exactly the tensor's bytes."""
    path = os.path.join(shm_dir, name)
    try:
        with open(path, "rb") as f:
            rec = f.read()
    except OSError as e:
        raise AttachError("record %s: %s" % (name, e))
    if len(rec) == GPU_RECORD_BYTES:
        raise AttachError("%s holds a CUDA IPC handle: this worker has no GPU" % name)
    if len(rec) != struct.calcsize(RECORD_FMT) or rec[:8] != RECORD_MAGIC:
        raise AttachError("%s is not a kvferry host-cache record (%d bytes)" % (name, len(rec)))
    _, off, size, _pid, p = struct.unpack(RECORD_FMT, rec)
    p = p.rstrip(b"\0").decode()
    page = mmap.ALLOCATIONGRANULARITY
    start = off - off % page
    fd = os.open(p, os.O_RDWR)
    try:
        m = mmap.mmap(fd, size + off - start, offset=start)
    finally:
        os.close(fd)
    return memoryview(m)[off - start:off - start + size]


class Caches:
    def __init__(self, rank, device, layers, key_only=False):
        self.t = {}
        for layer in range(layers):
            self.t[(layer, 0)] = attach_tensor("key_caches_%d_rank%d.device%d" % (layer, rank, device))
            if not key_only:
                self.t[(layer, 1)] = attach_tensor("value_caches_%d_rank%d.device%d" % (layer, rank, device))

    def tensor(self, layer, v):
        return self.t[(layer, v)]


_libc = ctypes.CDLL(None, use_errno=True)
_libc.ftok.restype, _libc.ftok.argtypes = ctypes.c_int, [ctypes.c_char_p, ctypes.c_int]
_libc.msgget.restype, _libc.msgget.argtypes = ctypes.c_int, [ctypes.c_int, ctypes.c_int]
_libc.msgsnd.restype, _libc.msgsnd.argtypes = ctypes.c_int, [ctypes.c_int, ctypes.c_void_p,
                                                             ctypes.c_size_t, ctypes.c_int]
_libc.msgctl.restype, _libc.msgctl.argtypes = ctypes.c_int, [ctypes.c_int, ctypes.c_int, ctypes.c_void_p]


class _Msg(ctypes.Structure):
    _fields_ = [("mtype", ctypes.c_long), ("mtext", ctypes.c_int * (512 * 3 + 2))]


class PerChunkSignal:
    """FastDeploy's per_chunk layer signal: one message per layer on the rank's queue."""

    def __init__(self, rank_id, device=0, stride=0):
        key = _libc.ftok(b"/opt/", 1024 + rank_id + stride * device)
        self.q = _libc.msgget(key, 0o1000 | 0o666)  # IPC_CREAT
        if self.q < 0:
            raise OSError(ctypes.get_errno(), "msgget")

    def send(self, layer, triples, count=None):
        m = _Msg(mtype=1)
        m.mtext[0] = len(triples) if count is None else count
        m.mtext[1] = layer
        for i, (slot, before, tokens) in enumerate(triples):
            m.mtext[2 + 3 * i], m.mtext[3 + 3 * i], m.mtext[4 + 3 * i] = slot, before, tokens
        if _libc.msgsnd(self.q, ctypes.byref(m), ctypes.sizeof(m.mtext), 0) < 0:
            raise OSError(ctypes.get_errno(), "msgsnd")

    def remove(self):
        _libc.msgctl(self.q, 0, None)  # IPC_RMID


class PerQuerySignal:
    """FastDeploy's per_query signal: the step (mod 100003) and the last layer written."""

    def __init__(self, rank_id, device, shm_dir="/dev/shm"):
        self.m = {}
        for what in ("step", "layer"):
            p = os.path.join(shm_dir, "splitwise_complete_prefilled_%s_%d.%d" % (what, rank_id, device))
            fd = os.open(p, os.O_RDWR | os.O_CREAT, 0o666)
            if os.fstat(fd).st_size < 4:
                os.ftruncate(fd, 4)
            self.m[what] = mmap.mmap(fd, 4)
            os.close(fd)
        self.paths = [os.path.join(shm_dir, "splitwise_complete_prefilled_%s_%d.%d" % (w, rank_id, device))
                      for w in ("step", "layer")]

    def step(self):
        return struct.unpack("<i", self.m["step"][:4])[0]

    def begin_step(self):
        """A forward step starts: the counter moves on, the layer goes back to -1."""
        s = (self.step() + 1) % STEP_MODULO
        struct.pack_into("<i", self.m["step"], 0, s)
        struct.pack_into("<i", self.m["layer"], 0, -1)
        return s

    def layer(self, layer):
        struct.pack_into("<i", self.m["layer"], 0, layer)

    def remove(self):
        for p in self.paths:
            try:
                os.unlink(p)
            except OSError:
                pass
