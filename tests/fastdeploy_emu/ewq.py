"""An emulated FastDeploy EngineWorkerQueue: the server (the same type ids, proxy types,
authkey and barriers FastDeploy registers) and the engine's side of the calls a messager
answers (put_cache_info, get_finished_req, put_connect_rdma_task, ...), written from the
documented protocol: each rank reads a broadcast once, each rank answers one item per round,
and a round is taken when every rank has answered."""
import threading
import time
from multiprocessing.managers import AcquirerProxy, BaseManager, ListProxy, Value, ValueProxy

AUTHKEY = b"secret_key"

# type id -> (what each data-parallel index holds, proxy type)
_LIST, _LOCK, _VALUE, _BARRIER, _QUEUE = range(5)
TYPES = {
    "get_tasks": _LIST, "get_client_read_flag": _LIST, "get_lock": _LOCK,
    "get_read_finish_flag": _VALUE, "get_exist_tasks_inter_signal": _VALUE,
    "get_connected_client_counter": _VALUE, "get_finish_request_queue": _LIST,
    "get_finish_add_cache_task_queue": _LIST, "get_cache_infos": _LIST,
    "get_client_read_info_flag": _LIST, "get_lock_info": _LOCK,
    "get_disaggregate_requests": _QUEUE, "get_finish_request_barrier": _BARRIER,
    "get_finish_add_cache_task_barrier": _BARRIER, "get_connect_task_barrier": _BARRIER,
    "get_connect_task_response_barrier": _BARRIER, "get_finish_send_cache_barrier": _BARRIER,
    "get_begin_send_cache_barrier": _BARRIER, "get_cache_info_barrier": _BARRIER,
    "get_connect_rdma_tasks": _LIST, "get_client_get_connect_task_flag": _LIST,
    "get_client_get_connect_task_response_flag": _LIST,
    "get_client_get_finished_add_cache_task_flag_init": _LIST,
    "get_client_get_finish_send_cache_flag_init": _LIST,
    "get_connect_rdma_tasks_responses": _LIST, "get_connect_task_lock": _LOCK,
    "get_connect_task_response_lock": _LOCK, "get_finish_add_cache_task_lock": _LOCK,
    "get_finish_send_cache_lock": _LOCK, "get_worker_process_tp_barrier": _BARRIER,
    "get_can_put_next_connect_task_response_flag": _VALUE,
    "get_can_put_next_add_task_finished_flag": _VALUE,
    "get_can_put_next_send_cache_finished_flag": _VALUE,
}
# initial values that are not empty lists / zero values
_INIT = {
    "get_client_read_flag": lambda n: [1] * n,
    "get_client_read_info_flag": lambda n: [0] * n,
    "get_client_get_connect_task_flag": lambda n: [0] * n,
    "get_client_get_connect_task_response_flag": lambda n: [0] * n,
    "get_client_get_finished_add_cache_task_flag_init": lambda n: [0] * n,
    "get_client_get_finish_send_cache_flag_init": lambda n: [0] * n,
    "get_can_put_next_connect_task_response_flag": lambda n: 1,
    "get_can_put_next_add_task_finished_flag": lambda n: 1,
    "get_can_put_next_send_cache_finished_flag": lambda n: 1,
}


def serve(address, nranks, dps=1):
    """Start the server (a process of its own); returns the manager (shutdown() stops it)."""
    import queue

    class _Server(BaseManager):
        pass

    objs = {}
    for tid, kind in TYPES.items():
        per = []
        for _ in range(dps):
            init = _INIT.get(tid)
            if kind == _LIST:
                per.append(init(nranks) if init else [])
            elif kind == _LOCK:
                per.append(threading.Lock())
            elif kind == _VALUE:
                per.append(Value("i", init(nranks) if init else 0))
            elif kind == _BARRIER:
                per.append(threading.Barrier(nranks))
            else:
                per.append(queue.Queue())
        objs[tid] = per
        proxy = {_LIST: ListProxy, _LOCK: AcquirerProxy, _VALUE: ValueProxy}.get(kind)
        kw = {"proxytype": proxy} if proxy else {}
        _Server.register(tid, callable=(lambda per: lambda idx: per[idx])(per), **kw)
    m = _Server(address=address, authkey=AUTHKEY)
    m.start()
    return m


class _held:
    def __init__(self, lock):
        self.lock = lock

    def __enter__(self):
        self.lock.acquire()

    def __exit__(self, *exc):
        self.lock.release()


class Engine:
    """The engine's side of the queue (one data-parallel index)."""

    def __init__(self, address, nranks, dp=0):
        class _C(BaseManager):
            pass

        for tid in TYPES:
            _C.register(tid)
        self.m = _C(address=address, authkey=AUTHKEY)
        for _ in range(50):
            try:
                self.m.connect()
                break
            except OSError:
                time.sleep(0.1)
        self.n = nranks
        g = lambda t: getattr(self.m, t)(dp)  # noqa: E731
        self.g = g
        self.lock_info, self.cache_infos, self.read_info = (
            g("get_lock_info"), g("get_cache_infos"), g("get_client_read_info_flag"))
        self.send_lock, self.finished, self.send_flags, self.can_put_send = (
            g("get_finish_send_cache_lock"), g("get_finish_request_queue"),
            g("get_client_get_finish_send_cache_flag_init"),
            g("get_can_put_next_send_cache_finished_flag"))
        self.add_lock, self.added, self.add_flags, self.can_put_add = (
            g("get_finish_add_cache_task_lock"), g("get_finish_add_cache_task_queue"),
            g("get_client_get_finished_add_cache_task_flag_init"),
            g("get_can_put_next_add_task_finished_flag"))
        self.conn_lock, self.conn_tasks, self.conn_flags = (
            g("get_connect_task_lock"), g("get_connect_rdma_tasks"),
            g("get_client_get_connect_task_flag"))
        self.resp_lock, self.responses, self.resp_flags, self.can_put_resp = (
            g("get_connect_task_response_lock"), g("get_connect_rdma_tasks_responses"),
            g("get_client_get_connect_task_response_flag"),
            g("get_can_put_next_connect_task_response_flag"))
        self.counter = g("get_connected_client_counter")

    def connected(self):
        return self.counter.get()

    def put_cache_info(self, infos, timeout=30):
        """Waits until every rank read the previous list, then replaces it."""
        end = time.monotonic() + timeout
        while True:
            with _held(self.lock_info):
                if sum(self.read_info[:]) >= self.n:
                    self.cache_infos[:] = []
                    self.read_info[:] = [0] * self.n
                    self.cache_infos.extend(infos)
                    return
            if time.monotonic() > end:
                raise TimeoutError("put_cache_info: the messagers did not read the last list")
            time.sleep(0.001)

    def _take_round(self, lock, out, flags, can_put, merge):
        with _held(lock):
            if len(out) == 0:
                return None
        while True:
            with _held(lock):
                if sum(flags[:]) >= self.n:
                    items = out[:]
                    out[:] = []
                    flags[:] = [0] * self.n
                    can_put.set(1)
                    return merge(items)
            time.sleep(0.001)

    def get_finished_req(self):
        """[[request_id, status]] once every rank answered (an error status wins), or []."""
        def merge(items):
            first = list(items[0])
            for it in items:
                if "error" in it[1]:
                    first[1] = it[1]
            return [first], items
        r = self._take_round(self.send_lock, self.finished, self.send_flags, self.can_put_send, merge)
        return r if r else ([], [])

    def get_finished_add_cache_task_req(self):
        r = self._take_round(self.add_lock, self.added, self.add_flags, self.can_put_add,
                             lambda items: items)
        return r or []

    def put_connect_rdma_task(self, task):
        while True:
            with _held(self.conn_lock):
                if sum(self.conn_flags[:]) >= self.n:
                    self.conn_tasks[:] = []
                    self.conn_flags[:] = [0] * self.n
                    self.conn_tasks.append(task)
                    return
            time.sleep(0.001)

    def get_connect_rdma_task_response(self):
        def merge(items):
            r = dict(items[0])
            for it in items:
                r["success"] = r["success"] and it["success"]
            return r
        return self._take_round(self.resp_lock, self.responses, self.resp_flags,
                                self.can_put_resp, merge)
