"""``bench.host_path_probe``: probes of the async host path, each read within its round against the handler as is."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from bench.host_path_probe import main, per_round, render
from serving_harness.loadgen import arrival_times
from tests.documented_commands import REPO

RUN_ARGS = {"handler": "ebird", "model": "bert-tiny1", "mode": "eager", "rates": [2000.0], "rounds": 2, "clients": 64,
            "seconds": 4.0, "warmup": 2.0, "open_seconds": 5.0, "max_batch": 32}  # fmt: skip
PROVENANCE = {"command": "python -m bench.host_path_probe", "commit": "abc", "date": "d", "machine": {}}


def test_a_probe_s_ratio_is_taken_within_each_round_against_the_handler_as_it_ships() -> None:
    # The machine slows in round 2: both read lower, the ratio within the round does not move.
    as_is = [{"capacity": 1000.0}, {"capacity": 500.0}, {"capacity": 800.0}]
    probe = [{"capacity": 1100.0}, {"capacity": 550.0}, {"capacity": 960.0}]
    assert per_round(probe, as_is, lambda r: r["capacity"]) == pytest.approx({"median": 1.1, "min": 1.1, "max": 1.2})


def test_every_probe_sees_the_same_arrivals_at_a_rate() -> None:
    # The bench draws each rate's arrivals with the load generator's ``arrival_times``, one seed per rate.
    times = arrival_times([(2.0, 2000.0)], seed=0)
    assert times == arrival_times([(2.0, 2000.0)], seed=0)
    assert times == sorted(times) and times[0] > 0 and times[-1] < 2.0
    assert 3600 < len(times) < 4400  # 2,000/s for 2 s


def test_the_table_gives_each_probe_s_capacity_host_time_and_latency_against_as_is() -> None:
    def run(capacity: float, mean_ms: float) -> dict:
        return {"capacity": capacity, "python_us": 120.0, "cpu_us": {"event loop": 40.0, "lanes": 80.0},
                "open": {"2000.0": {"mean_ms": mean_ms, "p99_ms": 3 * mean_ms, "failed": 0}}}  # fmt: skip

    data = {
        "args": RUN_ARGS,
        "runs": {"as-is": [run(1000.0, 10.0), run(800.0, 8.0)], "no-bookkeeping": [run(1100.0, 9.0), run(960.0, 6.0)]},
        "provenance": PROVENANCE,
    }
    table = render(data)
    assert "| no-bookkeeping | 1,030 (960-1,100) | 1.15× (1.10-1.20) | 120 | 40 | 7.5 ms, 0.82× (0.75-0.90) |" in table
    assert "Requests failed: 0" in table


@pytest.mark.parametrize(
    ("argv", "says"),
    [(["--probes", "no-bookkeeping"], "as-is among them"), (["--probes", "as-is,fast"], "choose from"),
     (["--rounds", "0"], "--rounds must be"), (["--rates", "2000,0"], "every rate > 0"),
     (["--probes", "as-is,reef-no-best-effort"], "use them with --handler reef")],
)  # fmt: skip
def test_a_run_that_could_not_be_read_against_the_handler_as_is_is_refused(argv, says, capsys) -> None:
    with pytest.raises(SystemExit):
        main(argv)
    assert says in capsys.readouterr().err


def test_the_wake_up_that_keeps_the_gil_still_delivers_what_another_thread_posts() -> None:
    # In a process of its own: the probe patches the mailbox for the whole process.
    script = textwrap.dedent(
        """
        import asyncio, threading
        from bench.host_path_probe import wake_keeping_the_gil
        from handlers.runtime.loop_mailbox import mailbox_for
        wake_keeping_the_gil()

        async def main():
            loop = asyncio.get_running_loop()
            got = loop.create_future()
            box = mailbox_for(loop)
            threading.Thread(target=lambda: box.post(lambda: got.set_result("answered"))).start()
            print(await asyncio.wait_for(got, 5), box.wakeups)

        asyncio.run(main())
        """
    )
    done = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["answered", "1"]


def test_the_async_floor_answers_every_message_with_its_own_status(tmp_path) -> None:
    # The reference probe serves the plain handler's pipeline behind the async burst driver: a malformed
    # body among good ones gets its own 400, every other request its 200 and the model's answer.
    import asyncio

    from archiver.options import ServingOptions
    from bench.direct import BurstCaller, load_context, model_dir_for
    from bench.dvabatch import bench_payloads
    from bench.host_path_probe import AsyncFloor
    from handlers.plain_handler import PlainModelHandler
    from model_store.catalog import get_spec
    from model_store.samples import request_body

    spec = get_spec("bert-tiny1", "eager")
    load = load_context(spec, model_dir_for(spec, tmp_path), ServingOptions(batch_size=4))
    caller = BurstCaller(AsyncFloor(PlainModelHandler(), load, max_batch=4), load)
    payloads, _ = bench_payloads(spec, count=9)
    rows = [{"body": request_body(p)} for p in payloads]
    rows[3] = {"body": b"{not json"}

    async def main():
        return await asyncio.gather(*(caller.request(row) for row in rows))

    answers = asyncio.run(main())
    assert [status for status, _ in answers] == [200, 200, 200, 400, 200, 200, 200, 200, 200]
    assert all(isinstance(answer, list | dict) for status, answer in answers if status == 200)


def test_the_table_reads_every_probe_against_the_plain_handler_where_it_was_probed() -> None:
    def run(capacity: float) -> dict:
        return {"capacity": capacity, "python_us": 100.0, "cpu_us": {"event loop": 10.0},
                "open": {"2000.0": {"mean_ms": 5.0, "p99_ms": 9.0, "failed": 0}}}  # fmt: skip

    data = {
        "args": RUN_ARGS,
        "runs": {
            "as-is": [run(600.0), run(500.0)],
            "nowait": [run(1000.0), run(800.0)],
            "async-floor": [run(900.0), run(760.0)],
        },  # fmt: skip
        "provenance": PROVENANCE,
    }
    table = render(data)
    assert "| ÷ nowait, per round |" in table
    assert "| async-floor | 830 (760-900) | 1.51× (1.50-1.52) | 0.93× (0.90-0.95) | 100 | 10 |" in table
    assert "| as-is | 550 (500-600) | 1.00× (1.00-1.00) | 0.61× (0.60-0.62) |" in table
