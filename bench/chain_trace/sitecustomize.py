"""Per-step timestamps for bench/chain.py, in every process it starts (this directory is put first on their
PYTHONPATH, so Python imports this module at start-up). With DELTASERVE_CHAIN_TRACE set to a directory it wraps
the step path's entry points and, at exit, writes (tag, seq, mark, perf_counter_ns) per step to
trace-<pid>.json there; perf_counter is CLOCK_MONOTONIC, the same clock in every process of the host.

Marks: executor ("x"): read (plan off the stream), launch0/launch1 (around runner.launch), bucket<B>,
prefill<T> (T prompt tokens in the step's chunks, when it has any), done (the step's tokens back: collect
begins), yield (output handed to the stream). Planner links ("g" gRPC, "i" in-process): send0/send1 (around
send), recv (output received). Planner engine ("s"): submit (a request queued, numbered in order)."""

import atexit
import json
import os
import time

_TRACE_DIR = os.environ.get("DELTASERVE_CHAIN_TRACE")

if _TRACE_DIR:
    _trace_dir = _TRACE_DIR  # a str: _write's name for it (the global's narrowing does not reach into a def)
    _records: list[tuple[str, int, str, int]] = []

    def _mark(tag: str, seq: int, name: str) -> None:
        _records.append((tag, int(seq), name, time.perf_counter_ns()))

    def _write() -> None:
        os.makedirs(_trace_dir, exist_ok=True)
        with open(os.path.join(_trace_dir, f"trace-{os.getpid()}.json"), "w") as out:
            json.dump(_records, out)

    atexit.register(_write)

    import bench.in_process as _in_process
    import executor_svc.runner as _runner
    import executor_svc.server as _server
    import planner_svc.engine as _engine
    import planner_svc.link as _link

    def _wrap_launch(launch):
        def traced(self, plan):
            _mark("x", plan.seq, "launch0")
            step = launch(self, plan)
            _mark("x", plan.seq, "launch1")
            _mark("x", plan.seq, f"bucket{plan.bucket}")
            if plan.prefill:
                _mark("x", plan.seq, f"prefill{sum(len(chunk.token_ids) // 4 for chunk in plan.prefill)}")
            return step

        return traced

    def _wrap_collect(collect):
        def traced(self, step):
            _mark("x", step.seq, "done")
            return collect(self, step)

        return traced

    def _wrap_steps(steps):
        async def traced(self, request_iterator, context):
            async def plans():
                async for plan in request_iterator:
                    _mark("x", plan.seq, "read")
                    yield plan

            async for output in steps(self, plans(), context):
                _mark("x", output.seq, "yield")
                yield output

        return traced

    def _wrap_link(cls, tag: str) -> None:
        send, recv = cls.send, cls.recv

        async def traced_send(self, plan):
            _mark(tag, plan.seq, "send0")
            await send(self, plan)
            _mark(tag, plan.seq, "send1")

        async def traced_recv(self):
            output = await recv(self)
            _mark(tag, output.seq, "recv")
            return output

        cls.send, cls.recv = traced_send, traced_recv

    def _wrap_submit(submit):
        submitted = iter(range(1 << 62))

        def traced(self, request):
            queue = submit(self, request)
            _mark("s", next(submitted), "submit")
            return queue

        return traced

    # Replacing the methods is this module's purpose (as bench/step_timeline.py's timed_launch does).
    _engine.Engine.submit = _wrap_submit(_engine.Engine.submit)  # type: ignore[method-assign]
    _runner.StepRunner.launch = _wrap_launch(_runner.StepRunner.launch)  # type: ignore[method-assign]
    _runner.StepRunner.collect = _wrap_collect(_runner.StepRunner.collect)  # type: ignore[method-assign]
    _servicer = _server.ExecutorServicer
    _servicer.Steps = _wrap_steps(_servicer.Steps)  # type: ignore[method-assign]
    _wrap_link(_link.GrpcLink, "g")
    _wrap_link(_in_process.InProcessLink, "i")
