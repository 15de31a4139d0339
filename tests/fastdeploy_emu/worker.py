"""An emulated FastDeploy model worker: attaches the caches a messager published, the way
FastDeploy's worker does (open each tensor's POSIX shared-memory record by FastDeploy's name,
map what it names, use the pointer with no offset), and raises the layer signals of either
mode (per_query: two int32 shm values; per_chunk: a System V message queue)."""
import ctypes
import mmap
import os
import struct
import time

RECORD_MAGIC = b"KVFHOST1"
RECORD_FMT = "<8sQQQ256s"
GPU_RECORD_BYTES = 72  # FastDeploy's { size_t nprocesses; cudaIpcMemHandle_t handle; }
STEP_MODULO = 100003


class AttachError(Exception):
    pass


class _Cuda:
    """The few CUDA runtime calls a FastDeploy worker makes to attach and fill its caches."""
    lib = None

    class Handle(ctypes.Structure):
        _fields_ = [("reserved", ctypes.c_char * 64)]

    @classmethod
    def get(cls):
        if cls.lib is None:
            names = [os.environ.get("CUDART_LIB", ""), "libcudart.so", "libcudart.so.13",
                     "libcudart.so.12", "/usr/local/cuda/lib64/libcudart.so"]
            for n in names:
                if not n:
                    continue
                try:
                    cls.lib = ctypes.CDLL(n)
                    break
                except OSError:
                    pass
            else:
                raise AttachError("no CUDA runtime (libcudart) to attach GPU caches with")
        return cls.lib


class DeviceTensor:
    """A tensor opened from FastDeploy's 72-byte record: cudaIpcOpenMemHandle, the pointer used
    with no offset. Slices read and write through cudaMemcpy."""

    def __init__(self, device, handle, size):
        cu = _Cuda.get()
        self.cu, self.device, self.size = cu, device, size
        self._set()
        ptr = ctypes.c_void_p()
        h = _Cuda.Handle()
        ctypes.memmove(ctypes.byref(h), handle, 64)
        cu.cudaIpcOpenMemHandle.argtypes = [ctypes.POINTER(ctypes.c_void_p), _Cuda.Handle, ctypes.c_uint]
        rc = cu.cudaIpcOpenMemHandle(ctypes.byref(ptr), h, 1)  # cudaIpcMemLazyEnablePeerAccess
        if rc != 0:
            raise AttachError("cudaIpcOpenMemHandle: CUDA error %d" % rc)
        self.ptr = ptr.value

    def _set(self):
        self.cu.cudaSetDevice(self.device)

    def __len__(self):
        return self.size

    def _range(self, k):
        a, b, _ = k.indices(self.size)
        return a, b

    def __setitem__(self, k, data):
        a, b = self._range(k)
        if len(data) != b - a:
            raise ValueError("%d bytes for a slice of %d" % (len(data), b - a))
        self._set()
        buf = ctypes.create_string_buffer(bytes(data), len(data))
        self.cu.cudaMemcpy.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        rc = self.cu.cudaMemcpy(ctypes.c_void_p(self.ptr + a), buf, b - a, 1)  # host to device
        if rc:
            raise AttachError("cudaMemcpy to the cache: CUDA error %d" % rc)
        # From pageable memory cudaMemcpy returns once the bytes are staged, before the DMA
        # into the cache has landed. FastDeploy fires its layer signal from a host function
        # queued after the cache-write kernel, i.e. once the bytes are in GPU memory: wait for
        # that here, or a signal sent next could let the messager copy stale bytes.
        rc = self.cu.cudaDeviceSynchronize()
        if rc:
            raise AttachError("cudaDeviceSynchronize after a cache write: CUDA error %d" % rc)

    def __getitem__(self, k):
        a, b = self._range(k)
        self._set()
        buf = ctypes.create_string_buffer(b - a)
        self.cu.cudaMemcpy.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        rc = self.cu.cudaMemcpy(buf, ctypes.c_void_p(self.ptr + a), b - a, 2)  # device to host
        if rc:
            raise AttachError("cudaMemcpy from the cache: CUDA error %d" % rc)
        return buf.raw


class GpuLayerWriter:
    """FastDeploy's way to write a layer's cache and announce it, on GPU caches: the write is
    queued on a stream of the worker's own (cudaMemcpyAsync from pinned host memory), and the
    layer signal is raised by a host function queued after it on the same stream
    (cudaLaunchHostFunc), so the signal fires once the bytes are in GPU memory and the host
    never waits for the GPU. The host function is a ctypes callback: it runs on the CUDA
    runtime's own thread, takes the GIL for the few lines of the signal, and makes no CUDA
    call (the runtime forbids it there)."""

    HOSTFN = ctypes.CFUNCTYPE(None, ctypes.c_void_p)
    CHUNK = 1 << 20  # pinned staging: bytes of writes packed together until a signal

    def __init__(self, device):
        cu = _Cuda.get()
        self.cu, self.device = cu, device
        cu.cudaSetDevice(device)
        vp, sz = ctypes.c_void_p, ctypes.c_size_t
        cu.cudaStreamCreateWithFlags.argtypes = [ctypes.POINTER(vp), ctypes.c_uint]
        cu.cudaMemcpyAsync.argtypes = [vp, vp, sz, ctypes.c_int, vp]
        cu.cudaLaunchHostFunc.argtypes = [vp, self.HOSTFN, vp]
        cu.cudaStreamSynchronize.argtypes = [vp]
        cu.cudaStreamDestroy.argtypes = [vp]
        cu.cudaHostAlloc.argtypes = [ctypes.POINTER(vp), sz, ctypes.c_uint]
        cu.cudaFreeHost.argtypes = [vp]
        self.stream = vp()
        # cudaStreamNonBlocking: the driver's synchronous reads of decode's cache (the legacy
        # default stream) neither wait for nor hold up this stream's writes and host functions.
        self._check(cu.cudaStreamCreateWithFlags(ctypes.byref(self.stream), 1),
                    "cudaStreamCreateWithFlags")
        # One callback object for the writer's life: the runtime holds only its C pointer,
        # so the object must outlive every host function queued with it.
        self._fn = self.HOSTFN(self._fire)
        self._pending = {}  # key (the host function's userData) -> (signal, its staging)
        self._key = 0
        self._free = []     # pinned chunks whose copies landed: [(ptr, size)]
        self._all = []      # every pinned chunk, freed at close
        self._cur = None    # [ptr, size, used] being filled
        self._staged = []   # chunks of the copies queued since the last host function
        self.errors = []    # exceptions the signals raised on the runtime's thread
        self.fired = 0
        self.fired_at = {}  # tag -> time.perf_counter() just before its signal was raised

    def _check(self, rc, what):
        if rc:
            raise AttachError("%s: CUDA error %d" % (what, rc))

    def _chunk(self, n):
        for i, (ptr, size) in enumerate(self._free):
            if size >= n:
                return list(self._free.pop(i)) + [0]
        size = max(n, self.CHUNK)
        ptr = ctypes.c_void_p()
        self._check(self.cu.cudaHostAlloc(ctypes.byref(ptr), size, 0), "cudaHostAlloc")
        self._all.append((ptr.value, size))
        return [ptr.value, size, 0]

    def write(self, tensor, offset, data):
        """Queue a copy of data into tensor (a DeviceTensor) at offset, on the stream."""
        n = len(data)
        if offset < 0 or offset + n > tensor.size:
            raise ValueError("write of %d bytes at %d past a tensor of %d" % (n, offset, tensor.size))
        if self._cur is None or self._cur[2] + n > self._cur[1]:
            if self._cur is not None:
                self._staged.append((self._cur[0], self._cur[1]))
            self._cur = self._chunk(n)
        src = self._cur[0] + self._cur[2]
        ctypes.memmove(src, bytes(data), n)
        self._cur[2] += n
        self.cu.cudaSetDevice(self.device)
        self._check(self.cu.cudaMemcpyAsync(ctypes.c_void_p(tensor.ptr + offset),
                                            ctypes.c_void_p(src), n, 1, self.stream),
                    "cudaMemcpyAsync to the cache")

    def signal_after(self, signal, tag=None):
        """Queue a host function that calls signal() once every write queued before it has
        landed; the staging of those writes is reused only after it ran."""
        if self._cur is not None:
            self._staged.append((self._cur[0], self._cur[1]))
            self._cur = None
        self._key += 1
        key = self._key
        self._pending[key] = (signal, self._staged, tag)
        self._staged = []
        rc = self.cu.cudaLaunchHostFunc(self.stream, self._fn, ctypes.c_void_p(key))
        if rc:
            self._free.extend(self._pending.pop(key)[1])
            self._check(rc, "cudaLaunchHostFunc")

    def _fire(self, user_data):
        # On the CUDA runtime's thread: no CUDA calls here.
        signal, staged, tag = self._pending.pop(user_data)
        try:
            t = time.perf_counter()
            signal()
            if tag is not None:
                self.fired_at[tag] = t
        except Exception as e:  # raised on the main thread by drain()
            self.errors.append(e)
        self._free.extend(staged)
        self.fired += 1

    def drain(self):
        """Wait for every queued write and signal; raise what a signal raised."""
        self.cu.cudaSetDevice(self.device)
        self._check(self.cu.cudaStreamSynchronize(self.stream), "cudaStreamSynchronize")
        if self.errors:
            e, self.errors = self.errors[0], []
            raise AttachError("a layer signal raised on the host function: %r" % (e,))

    def close(self):
        try:
            self.drain()
        finally:
            self.cu.cudaStreamDestroy(self.stream)
            for ptr, _ in self._all:
                self.cu.cudaFreeHost(ctypes.c_void_p(ptr))
            self._all, self._free = [], []


def attach_tensor(name, shm_dir="/dev/shm", device=None, size=None):
    """The tensor named `name` (key_caches_{layer}_rank{rank}.device{device}): a writable
    memoryview of exactly the tensor's bytes."""
    path = os.path.join(shm_dir, name)
    try:
        with open(path, "rb") as f:
            rec = f.read()
    except OSError as e:
        raise AttachError("record %s: %s" % (name, e))
    if len(rec) == GPU_RECORD_BYTES:
        if device is None or size is None:
            raise AttachError("%s holds a CUDA IPC handle: give the device and size" % name)
        return DeviceTensor(device, rec[8:72], size)
    if len(rec) != struct.calcsize(RECORD_FMT) or rec[:8] != RECORD_MAGIC:
        raise AttachError("%s is not a kvferry host-cache record (%d bytes)" % (name, len(rec)))
    _, off, size, _pid, p = struct.unpack(RECORD_FMT, rec)
    p = p.rstrip(b"\0").decode()
    fd = os.open(p, os.O_RDWR)
    try:
        # The file's own page size: 2 MiB on hugetlbfs, where a mapping's offset and length
        # must be whole pages (mmap says EINVAL otherwise)
        page = max(mmap.ALLOCATIONGRANULARITY, os.fstat(fd).st_blksize)
        start = off - off % page
        length = -(-(size + off - start) // page) * page
        m = mmap.mmap(fd, length, offset=start)
    finally:
        os.close(fd)
    return memoryview(m)[off - start:off - start + size]


class Caches:
    """A rank's caches by FastDeploy's names: tensor(layer, v) is K (0) or V (1), and with
    scale_bytes (block_wise_fp8) their scale tensors key_cache_scales_... (2) and
    value_cache_scales_... (3)."""

    def __init__(self, rank, device, layers, key_only=False, tensor_bytes=None, suffix="",
                 scale_bytes=0):
        self.t = {}
        sfx = "." + suffix if suffix else ""
        kinds = [(0, "key_caches", tensor_bytes), (1, "value_caches", tensor_bytes)]
        if scale_bytes:
            kinds += [(2, "key_cache_scales", scale_bytes), (3, "value_cache_scales", scale_bytes)]
        for layer in range(layers):
            for v, kind, size in kinds:
                if key_only and v % 2:
                    continue
                self.t[(layer, v)] = attach_tensor("%s_%d_rank%d.device%d%s"
                                                   % (kind, layer, rank, device, sfx),
                                                   device=device, size=size)

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
        # One aligned store a value, as FastDeploy's C++ writes it: struct.pack_into clears the
        # bytes first, and the messager, polling, would read that 0 as the layer value.
        self.v = {what: memoryview(m).cast("i") for what, m in self.m.items()}
        self.paths = [os.path.join(shm_dir, "splitwise_complete_prefilled_%s_%d.%d" % (w, rank_id, device))
                      for w in ("step", "layer")]

    def step(self):
        return self.v["step"][0]

    def begin_step(self, stall_s=0.0):
        """A forward step starts: the counter moves on, the layer goes back to -1 (stall_s
        between the two: an engine thread held up there, the old step's last layer still
        standing beside the new step)."""
        s = (self.step() + 1) % STEP_MODULO
        self.v["step"][0] = s
        if stall_s:
            time.sleep(stall_s)
        self.v["layer"][0] = -1
        return s

    def layer(self, layer):
        self.v["layer"][0] = layer

    def remove(self):
        for p in self.paths:
            try:
                os.unlink(p)
            except OSError:
                pass
