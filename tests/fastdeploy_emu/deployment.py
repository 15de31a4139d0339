"""An emulated FastDeploy prefill/decode deployment on one host, driving kvferry through
FastDeploy's interfaces alone: EngineWorkerQueue servers, one `python3 -m kvferry.fastdeploy`
messager per rank with FastDeploy's argv, caches attached from the published records, layer
signals of either mode, task halves moved the way FastDeploy's splitwise connector moves them
(both halves into the prefill engine's queue), statuses read with get_finished_req."""
import json
import os
import signal
import socket
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import ewq  # noqa: E402
import worker  # noqa: E402

ROOT = os.path.normpath(os.path.join(HERE, "..", ".."))


def free_port():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    p = s.getsockname()[1]
    s.close()
    return p


class Shape:
    """scales: FastDeploy's block_wise_fp8 caches, uint8 K/V and a bfloat16 scale tensor
    [blocks, heads, block_size] beside each."""

    def __init__(self, layers=4, blocks=256, heads=2, block_size=16, head_dim=32, dtype="bfloat16",
                 extra=0, scales=False):
        self.layers, self.blocks, self.heads = layers, blocks, heads
        self.extra, self.all_layers = extra, layers + extra
        self.block_size, self.head_dim = block_size, head_dim
        self.dtype = "block_wise_fp8" if scales else dtype
        self.block_bytes = heads * block_size * head_dim * (1 if scales else 2)
        self.scale_bytes = heads * block_size * 2 if scales else 0

    @property
    def shape(self):
        return "%d,%d,%d,%d" % (self.blocks, self.heads, self.block_size, self.head_dim)

    def tensors(self):
        """Each tensor of a layer as (v, bytes of one block): K, V, then their scales."""
        kv = [(0, self.block_bytes), (1, self.block_bytes)]
        return kv + ([(2, self.scale_bytes), (3, self.scale_bytes)] if self.scale_bytes else [])


class Instance:
    """One emulated FastDeploy instance (prefill or decode): its queue server, its
    cache_ready_signal, a messager per rank, and the worker's view of each rank's caches."""

    def __init__(self, role, tp, shape, devices, mode, protocol, tag, logdir, rdma_ports=None,
                 older=False, gpu=False):
        self.role, self.tp, self.shape, self.devices = role, tp, shape, devices
        self.mode, self.protocol = mode, protocol
        self.port = free_port()
        self.suffix = "%s%s" % (tag, role[0])
        # FD_ENGINE_TASK_QUEUE_WITH_SHM: the queue on a unix socket named by the port
        self.addr = "/dev/shm/fd_task_queue_%d.sock" % self.port if older else \
            ("127.0.0.1", self.port)
        self.server = ewq.serve(self.addr, tp)
        self.engine = ewq.Engine(self.addr, tp)
        self.ready_path = "/dev/shm/cache_ready_signal.%s" % self.suffix
        with open(self.ready_path, "wb") as f:  # the engine makes it, as FastDeploy's does
            f.write(b"\0" * 4 * tp)
        self.rdma_ports = rdma_ports or [free_port() for _ in range(tp)]
        self.procs = []
        self.logs = []
        env = dict(os.environ, PYTHONPATH=os.path.join(ROOT, "python"))
        if mode == "per_chunk":
            env.update(FLAGS_use_pd_disaggregation_per_chunk="1", ENABLE_V1_KVCACHE_SCHEDULER="1")
        else:
            env.update(FLAGS_use_pd_disaggregation="1")
            env.pop("FLAGS_use_pd_disaggregation_per_chunk", None)
            env.pop("ENABLE_V1_KVCACHE_SCHEDULER", None)
        if older:
            env["FD_ENGINE_TASK_QUEUE_WITH_SHM"] = "1"
        # decode on the GPUs prefill uses (one GPU): its records get FastDeploy's suffix
        self.name_suffix = "d" if gpu and role == "decode" else ""
        if self.name_suffix:
            env["FD_IPC_APPEND_SUFFIX"] = self.name_suffix
        spec = json.dumps({"method": "mtp", "num_speculative_tokens": 1} if shape.extra else {})
        for r in range(tp):
            argv = [sys.executable, "-m", "kvferry.fastdeploy",
                    "--splitwise_role", role, "--rank", str(r), "--device_id", str(devices[r]),
                    "--mp_num", str(tp), "--cache_dtype", shape.dtype, "--pod_ip", "127.0.0.1",
                    "--engine_worker_queue_port", str(self.port), "--protocol", protocol,
                    "--local_data_parallel_id", "0", "--rdma_port", str(self.rdma_ports[r]),
                    "--speculative_config", spec]
            if older:  # FastDeploy's first messager: the engine's pid, the shape in pieces
                argv += ["--engine_pid", self.suffix, "--num_hidden_layers", str(shape.layers),
                         "--num_gpu_blocks", str(shape.blocks), "--kv_num_head", str(shape.heads),
                         "--block_size", str(shape.block_size), "--head_dim", str(shape.head_dim)]
            else:
                argv += ["--ipc_suffix", self.suffix, "--num_layers", str(shape.layers),
                         "--key_cache_shape", shape.shape, "--value_cache_shape", shape.shape,
                         "--default_dtype", "bfloat16", "--cache_queue_port", str(free_port())]
            if gpu:
                argv += ["--kvf-backend", "cuda"]
            argv += ["--kvf-msg-key-device-stride", "1", "--kvf-tasks-over", "tcp",
                     "--kvf-up-arg", "--request-timeout-ms 20000"]
            log = open(os.path.join(logdir, "messager-%s-%d.log" % (role, r)), "w")
            self.logs.append(log.name)
            self.procs.append(subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env,
                                               start_new_session=True))
        self.caches = []
        self.signals = []

    def wait_ready(self, timeout=90):
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            with open(self.ready_path, "rb") as f:
                v = f.read(4 * self.tp)
            if sum(int.from_bytes(v[4 * i:4 * i + 4], "little", signed=True)
                   for i in range(self.tp)) == self.tp:
                break
            for p in self.procs:
                if p.poll() is not None:
                    raise RuntimeError("%s messager exited %d before ready:\n%s" %
                                       (self.role, p.returncode, self.log_tail()))
            time.sleep(0.1)
        else:
            raise RuntimeError("%s: cache_ready_signal not set within %d s:\n%s" %
                               (self.role, timeout, self.log_tail()))
        self.caches = [worker.Caches(r, self.devices[r], self.shape.all_layers,
                                     tensor_bytes=self.shape.blocks * self.shape.block_bytes,
                                     suffix=self.name_suffix,
                                     scale_bytes=self.shape.blocks * self.shape.scale_bytes)
                       for r in range(self.tp)]
        if self.role == "prefill":
            for r in range(self.tp):
                if self.mode == "per_chunk":
                    self.signals.append(worker.PerChunkSignal(r, self.devices[r], stride=1))
                else:
                    self.signals.append(worker.PerQuerySignal(r, self.devices[r]))
        if self.role == "prefill" and self.mode == "per_chunk":
            import threading
            self.added = []
            threading.Thread(target=self._drain_added, daemon=True).start()
        # the messagers are clients of the queue now
        end = time.monotonic() + 30
        while self.engine.connected() < self.tp and time.monotonic() < end:
            time.sleep(0.05)

    def restart_queue(self, down_s=1.5):
        """The engine's queue server goes away and comes back on the same port."""
        self.server.shutdown()
        time.sleep(down_s)
        for p in self.procs:
            if p.poll() is not None:
                raise RuntimeError("a %s messager exited %d when the queue went away:\n%s"
                                   % (self.role, p.returncode, self.log_tail()))
        self.server = ewq.serve(self.addr, self.tp)
        self.engine = ewq.Engine(self.addr, self.tp)
        if self.role == "prefill" and self.mode == "per_chunk":
            import threading
            threading.Thread(target=self._drain_added, daemon=True).start()
        end = time.monotonic() + 30
        while self.engine.connected() < self.tp and time.monotonic() < end:
            time.sleep(0.05)
        if self.engine.connected() < self.tp:
            raise RuntimeError("the messagers did not come back to the queue:\n" + self.log_tail())

    def _drain_added(self):
        """V1: the engine takes the messagers' "cache task added" answers as they come."""
        eng = ewq.Engine(self.addr, self.tp)
        while True:
            try:
                r = eng.get_finished_add_cache_task_req()
            except (EOFError, OSError):
                return
            if r:
                if any(x != r[0] for x in r):
                    self.added.append(("ranks differ", r))
                self.added.append(r[0])
            else:
                time.sleep(0.002)

    def log_tail(self, n=15):
        out = []
        for name in self.logs:
            try:
                with open(name) as f:
                    lines = f.readlines()[-n:]
                out.append("--- %s\n%s" % (name, "".join(lines)))
            except OSError:
                pass
        return "\n".join(out)

    def stop(self, timeout=20):
        for p in self.procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        end = time.monotonic() + timeout
        codes = []
        for p in self.procs:
            try:
                codes.append(p.wait(max(0.1, end - time.monotonic())))
            except subprocess.TimeoutExpired:
                p.kill()
                codes.append("hung")
        for s in self.signals:
            if isinstance(s, worker.PerChunkSignal):
                s.remove()
            else:
                s.remove()
        try:
            os.unlink(self.ready_path)
        except OSError:
            pass
        try:
            self.server.shutdown()
        except Exception:
            pass
        return codes


def trace_lengths(n, path=os.path.join(ROOT, "data", "mooncake-conversation-2000.jsonl")):
    out = []
    with open(path) as f:
        for line in f:
            out.append(json.loads(line)["input_length"])
            if len(out) == n:
                break
    return out


def pattern(req, layer, v, bi, rank, nbytes):
    head = ("%s:%d:%d:%d:%d|" % (req, layer, v, bi, rank)).encode()
    return (head * (nbytes // len(head) + 1))[:nbytes]
