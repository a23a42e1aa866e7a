"""Fault injection: real jobs (ranks started directly, no launcher agent, so only the framework decides what happens),
a real fault (kill -9, SIGSTOP, an env that raises or returns NaN, an update that turns NaN), then: every rank ends
with its defined exit code and one line naming itself, rank 0's job summary names the first cause where it can
know it, nothing hangs past the timeout plus a margin, and no process outlives the job.

Layouts: the 2-rank colocated job and the 4-rank split job (rank 0 trainer 0, rank 1 inference 0, ranks 2-3 env
0-1). The full matrix is marked slow; the default run keeps one case of each kind of fault.
"""

from __future__ import annotations

import datetime
import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from harness.launch import free_port, rank_env
from harness.multiproc import run_ranks

from spmd_rl.runtime.distributed import Peer, comm_error
from spmd_rl.runtime.errors import COMM_ERROR_EXIT_CODE, USER_CODE_EXIT_CODE, CommError
from spmd_rl.runtime.postmortem import SPOKEN_MARKER, Failure, after_failure, first_cause

REPO = Path(__file__).resolve().parents[2]
TIMEOUT_S = 15  # dist.timeout_s of every job: long enough for 4 ranks to start on a loaded 2-core machine
MARGIN_S = 30  # on top of the timeout: the job summary's grace, teardown, a loaded machine
START_S = 180  # for the first iteration to be logged
KILLED = -signal.SIGKILL
SPLIT = ["layout.mode=split", "layout.trainer=1", "layout.inference=1", "layout.env=2"]
NAMES = {
    "colocated": {0: "rank 0 (colocated 0)", 1: "rank 1 (colocated 1)"},
    "split": {0: "rank 0 (trainer 0)", 1: "rank 1 (inference 0)", 2: "rank 2 (env 0)", 3: "rank 3 (env 1)"},
}
WORLD = {"colocated": 2, "split": 4}


class Job:
    """The ranks of one run, each a `python -m spmd_rl.main` process with the torchrun variables set by hand."""

    def __init__(
        self,
        tmp_path: Path,
        layout: str,
        overrides: list[str] = (),
        total_steps: int = 10**8,
        timeout_s: int = TIMEOUT_S,
    ):
        self.layout, self.world = layout, WORLD[layout]
        self.run_dir = tmp_path / "run"  # on every rank's command line: what `pgrep -f` looks for
        self.logs = tmp_path
        port = free_port()
        command = [
            sys.executable,
            "-m",
            "spmd_rl.main",
            "--config",
            "configs/ci_tiny.yaml",
            f"run.dir={self.run_dir}",
            f"train.total_steps={total_steps}",
            f"dist.timeout_s={timeout_s}",
            *(SPLIT if layout == "split" else []),
            *overrides,
        ]
        self.procs = []
        for rank in range(self.world):
            env = rank_env(rank, self.world, port, PYTHONPATH=str(REPO), SPMD_RL_DEBUG="")
            with open(self.logs / f"stdout{rank}", "w") as out, open(self.logs / f"stderr{rank}", "w") as err:
                self.procs.append(subprocess.Popen(command, cwd=REPO, env=env, stdout=out, stderr=err))
        self.ended_at: dict[int, float] = {}

    def wait_until_training(self) -> None:
        metrics = self.run_dir / "metrics.jsonl"
        give_up_at = time.monotonic() + START_S
        while not (metrics.exists() and metrics.read_text().count("\n") >= 2):
            assert time.monotonic() < give_up_at, f"no iteration logged within {START_S}s: {self.stderr(0)}"
            assert all(p.poll() is None for p in self.procs), f"a rank ended before training: {self.all_stderr()}"
            time.sleep(0.2)

    def signal_when_training(self, rank: int, signum: int) -> float:
        """Send signum to rank once the job is training; returns when it was sent (time.monotonic)."""
        self.wait_until_training()
        self.procs[rank].send_signal(signum)
        return time.monotonic()

    def wait(self, ranks, deadline_s: float) -> None:
        """Until every rank in `ranks` has exited (recording when), for at most deadline_s."""
        give_up_at = time.monotonic() + deadline_s
        while time.monotonic() < give_up_at and any(self.procs[r].poll() is None for r in ranks):
            for rank in ranks:
                if rank not in self.ended_at and self.procs[rank].poll() is not None:
                    self.ended_at[rank] = time.monotonic()
            time.sleep(0.05)
        for rank in ranks:
            if rank not in self.ended_at and self.procs[rank].poll() is not None:
                self.ended_at[rank] = time.monotonic()

    def codes(self) -> list[int | None]:
        return [p.poll() for p in self.procs]

    def stderr(self, rank: int) -> str:
        return (self.logs / f"stderr{rank}").read_text()

    def all_stderr(self) -> str:
        return "\n".join(f"--- rank {r}:\n{self.stderr(r)[-3000:]}" for r in range(self.world))

    def name(self, rank: int) -> str:
        return NAMES[self.layout][rank]

    def close(self) -> None:
        """Kill whatever is left (a failed test must not leave ranks behind), then check nothing is."""
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()
            proc.wait()
        left = subprocess.run(["pgrep", "-f", str(self.run_dir)], capture_output=True, text=True).stdout.split()
        assert not left, f"processes outlived the job: {left}"


@pytest.fixture
def jobs(tmp_path):
    started = []

    def start(layout: str, overrides: list[str] = (), total_steps: int = 10**8, timeout_s: int = TIMEOUT_S) -> Job:
        job = Job(tmp_path, layout, overrides, total_steps, timeout_s)
        started.append(job)
        return job

    yield start
    for job in started:
        job.close()


def check_lines(job: Job, expected: dict[int, tuple[int, str]]) -> str:
    """Every rank in `expected` exited with its code and printed exactly one line naming itself with the kind of
    failure, and no traceback. Returns rank 0's job summary ('' without one)."""
    assert job.codes() == [expected[r][0] if r in expected else KILLED for r in range(job.world)], job.all_stderr()
    for rank, (_, kind) in expected.items():
        text = job.stderr(rank)
        assert "Traceback" not in text, job.all_stderr()
        lines = [line for line in text.splitlines() if line.startswith("spmd_rl: ") and "job summary" not in line]
        assert len(lines) == 1, job.all_stderr()
        assert lines[0].startswith(f"spmd_rl: {job.name(rank)}: {kind}: "), job.all_stderr()
    summary = [line for line in job.stderr(0).splitlines() if line.startswith("spmd_rl: job summary: ")]
    return summary[0] if summary else ""


def check_ended_in_time(job: Job, since: float, ranks) -> None:
    late = {r: round(job.ended_at[r] - since, 1) for r in ranks if job.ended_at[r] - since > TIMEOUT_S + MARGIN_S}
    assert not late, f"ranks ended later than dist.timeout_s + {MARGIN_S}s after the fault (rank: s): {late}"
    print(
        f"{job.layout}: seconds from the fault to each rank's exit: "
        f"{ {r: round(job.ended_at[r] - since, 1) for r in sorted(ranks)} }"
    )


# -- a rank killed (kill -9) ---------------------------------------------------------------------------------------

VICTIMS = {  # a case's id: (layout, the rank the fault hits)
    "colocated-rank1": ("colocated", 1),
    "split-trainer": ("split", 0),
    "split-inference": ("split", 1),
    "split-env": ("split", 2),
}


def victim_cases(quick: str) -> list:
    """Every layout and victim, the quick case first; the others are marked slow."""
    order = [quick, *(case for case in VICTIMS if case != quick)]
    return [pytest.param(*VICTIMS[case], id=case, marks=[] if case == quick else pytest.mark.slow) for case in order]


KILL_CASES = victim_cases(quick="colocated-rank1")


@pytest.mark.parametrize("layout, victim", KILL_CASES)
def test_a_killed_rank_ends_the_job_with_one_line_per_rank(jobs, layout, victim):
    job = jobs(layout)
    killed_at = job.signal_when_training(victim, signal.SIGKILL)
    survivors = [r for r in range(job.world) if r != victim]
    job.wait(range(job.world), TIMEOUT_S + MARGIN_S)
    summary = check_lines(job, {r: (COMM_ERROR_EXIT_CODE, "communication error") for r in survivors})
    check_ended_in_time(job, killed_at, survivors)
    if victim != 0:  # rank 0 holds the job's store: when it dies, nobody can gather the records
        # The killed rank is named first; a survivor still blocked in a collective with it (the end-of-iteration
        # agreement spans every rank) may not have reported yet, and is then named beside it.
        first = summary.removeprefix("spmd_rl: job summary: ").split(" stopped responding first")[0]
        assert summary.startswith("spmd_rl: job summary: ") and " stopped responding first" in summary, summary
        assert job.name(victim) in first.split(", "), summary


def test_a_killed_fsdp_trainer_leaves_one_line_and_the_summary(jobs):
    # Colocated with train.parallel=fsdp every rank's act all-gathers the sharded policy: the survivor's gather
    # from the killed rank fails inside FSDP2 as a plain RuntimeError (was: its traceback, exit 1, no summary).
    # Long rollouts, one short update: the kill lands while the survivor acts (learn maps its own failures)
    job = jobs("colocated", ["train.parallel=fsdp", "algo.num_steps=1024", "algo.update_epochs=1"])
    killed_at = job.signal_when_training(1, signal.SIGKILL)
    job.wait(range(job.world), TIMEOUT_S + MARGIN_S)
    summary = check_lines(job, {0: (COMM_ERROR_EXIT_CODE, "communication error")})
    check_ended_in_time(job, killed_at, [0])
    assert summary.startswith(f"spmd_rl: job summary: {job.name(1)} stopped responding first"), summary


# -- a rank stopped (SIGSTOP): the others time out; the stopped one, resumed, finds them gone -------------------------

STOP_CASES = victim_cases(quick="split-env")


@pytest.mark.parametrize("layout, victim", STOP_CASES)
def test_a_stopped_rank_is_named_as_the_first_cause(jobs, layout, victim):
    job = jobs(layout)
    stopped_at = job.signal_when_training(victim, signal.SIGSTOP)
    others = [r for r in range(job.world) if r != victim]
    job.wait(others, TIMEOUT_S + MARGIN_S)
    check_ended_in_time(job, stopped_at, others)
    job.procs[victim].send_signal(signal.SIGCONT)  # what a launcher would kill; resumed, it must end by itself
    resumed_at = time.monotonic()
    job.wait([victim], MARGIN_S)
    assert job.procs[victim].poll() is not None, f"the resumed rank {victim} did not end within {MARGIN_S}s"
    summary = check_lines(job, {r: (COMM_ERROR_EXIT_CODE, "communication error") for r in range(job.world)})
    print(f"the resumed rank ended {job.ended_at[victim] - resumed_at:.1f}s after SIGCONT")
    # Rank 0 stopped: on SIGCONT it finds every peer gone, and tells its own stall from its peers' timeouts.
    assert summary.startswith(f"spmd_rl: job summary: {job.name(victim)} stopped responding first"), summary
    timed_out = [r for r in others if "did not respond within" in job.stderr(r)]
    assert timed_out, job.all_stderr()  # whoever waited on the stopped rank says it may be a knock-on
    assert all("may itself be waiting on another rank" in job.stderr(r) for r in timed_out)


# -- the user's env fails ------------------------------------------------------------------------------------------

ENV_CASES = [
    pytest.param("colocated", 1, "raise", id="colocated-raise"),
    pytest.param("split", 3, "nan_obs", id="split-nan-observation"),
    pytest.param("split", 3, "raise", id="split-raise", marks=pytest.mark.slow),
    pytest.param("colocated", 1, "nan_reward", id="colocated-nan-reward", marks=pytest.mark.slow),
]


@pytest.mark.parametrize("layout, culprit, fault", ENV_CASES)
def test_an_env_that_fails_is_an_error_in_user_code_naming_it(jobs, layout, culprit, fault):
    job = jobs(
        layout,
        ["env.id=tests.harness.faulty_env:Faulty-v0", f"env.kwargs={{fault: {fault}, rank: {culprit}, after: 40}}"],
    )
    job.wait(range(job.world), START_S + TIMEOUT_S + MARGIN_S)
    expected = {r: (COMM_ERROR_EXIT_CODE, "communication error") for r in range(job.world)}
    expected[culprit] = (USER_CODE_EXIT_CODE, "error in user code")
    summary = check_lines(job, expected)
    check_ended_in_time(job, job.ended_at[culprit], range(job.world))  # the culprit exits at once
    line = job.stderr(culprit)
    assert "env 'tests.harness.faulty_env:Faulty-v0'" in line
    if fault == "raise":  # the user's exception, and the user's file:line, through the vector env and its wrappers
        assert "ValueError: Faulty-v0: deliberate failure after 40 steps (at " in line
        assert f"{REPO / 'tests' / 'harness' / 'faulty_env.py'}:" in line
    else:
        what = "observation" if fault == "nan_obs" else "reward"
        assert f"returned a non-finite {what} (NaN or inf) at step " in line
    assert summary.startswith(f"spmd_rl: job summary: {job.name(culprit)} failed first (error in user code"), summary


# -- an update that turns NaN -------------------------------------------------------------------------------------

POISON = ["algo.class=tests.harness.faulty_env:PoisonedPPO", "algo.poison_iteration=2"]


def run_alone(tmp_path: Path, overrides: list[str]) -> subprocess.CompletedProcess:
    command = [
        sys.executable,
        "-m",
        "spmd_rl.main",
        "--config",
        "configs/ci_tiny.yaml",
        f"run.dir={tmp_path / 'run'}",
        *POISON,
        *overrides,
    ]
    return subprocess.run(
        command, cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)}, capture_output=True, text=True, timeout=START_S
    )


def test_a_nonfinite_update_is_an_error_naming_the_iteration(tmp_path):
    result = run_alone(tmp_path, [])
    assert result.returncode == USER_CODE_EXIT_CODE, result.stderr
    assert result.stderr.strip().splitlines() == [
        "spmd_rl: error in user code: the update of iteration 2 produced a non-finite loss "
        "(policy_loss=nan, value_loss=nan); fix the algorithm or its settings (learning rate, gradient clipping), or "
        "set train.skip_nonfinite_updates=true to skip such updates"
    ]


def check_skipped_once(run_dir: Path) -> None:
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["nonfinite_updates_skipped"] for r in records] == [0, 0] + [1] * (len(records) - 2)
    assert records[2]["policy_loss"] is None  # the skipped update's own losses, logged as they were
    # Later updates are finite: the weights AND Adam's moments were restored, or every update after would be NaN.
    assert all(math.isfinite(r["policy_loss"]) and math.isfinite(r["value_loss"]) for r in records[3:])
    weights = torch.load(run_dir / "policy.pt")
    assert all(bool(torch.isfinite(w).all()) for w in weights.values() if w.is_floating_point())


def test_skip_nonfinite_updates_undoes_and_counts_the_update(tmp_path):
    result = run_alone(tmp_path, ["train.skip_nonfinite_updates=true"])
    assert result.returncode == 0, result.stderr
    check_skipped_once(tmp_path / "run")


@pytest.mark.slow
def test_trainers_agree_to_skip_a_nonfinite_update(jobs):
    # No fault to time here: a bound of 60 s, not 15, so that a loaded machine's slow import of the plug-in module
    # (over 15 s once in CI, where the watchdog ended the run) does not decide the test.
    job = jobs("colocated", [*POISON, "train.skip_nonfinite_updates=true"], total_steps=512, timeout_s=60)
    job.wait(range(job.world), START_S)
    assert job.codes() == [0, 0], job.all_stderr()
    check_skipped_once(job.run_dir)


# -- the pieces, without a job -------------------------------------------------------------------------------------


def _send_to_a_dead_peer(rank, world_size):
    from tensordict import TensorDict

    from spmd_rl.comm.channel_setup import open_channels

    message = TensorDict({"x": torch.zeros(4)}, batch_size=[])
    if rank == 1:
        _, (channel,) = open_channels(sends=[], recvs=[(0, "segments", None)], me=1, timeout=10)
        channel.recv()
        os._exit(7)  # a crash: its connections close
    (channel,), _ = open_channels(sends=[(1, "segments", message)], recvs=[], me=0, timeout=10)
    channel.send()
    time.sleep(1)  # rank 1 is gone: gloo fails the next isend's post itself ("Connection closed by peer")
    with pytest.raises(
        CommError,
        match=r"^rank 0: send of message 2 on channel 'segments' to rank 1 failed: rank 1 "
        r"closed the connection: it exited first",
    ) as error:
        channel.send()
    assert error.value.peers == (1,) and not error.value.timed_out
    raise error.value


def test_a_send_to_a_dead_peer_is_a_comm_error_naming_both():
    assert run_ranks(_send_to_a_dead_peer, 2, timeout_s=20) == [COMM_ERROR_EXIT_CODE, 7]


def test_comm_error_tells_a_timeout_from_a_closed_connection():
    timeout = datetime.timedelta(seconds=10)
    peer = Peer("rank 2 (env 0)", (2,))
    expired = comm_error(
        "rank 1 (inference 0): receive of message 7",
        RuntimeError(
            "[/pytorch/third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting 10000ms for recv "
            "operation to complete"
        ),
        timeout,
        peer,
    )
    assert str(expired) == (
        "rank 1 (inference 0): receive of message 7 failed: rank 2 (env 0) did not respond within "
        "dist.timeout_s=10s: it is stopped or hung, or it may itself be waiting on another rank (a "
        "knock-on) [Timed out waiting 10000ms for recv operation to complete]"
    )
    assert expired.timed_out and expired.peers == (2,)
    closed = comm_error(
        "rank 0 (trainer 0): learning",
        RuntimeError(
            "[/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:537] Read error [127.0.0.1]:5256: "
            "Connection reset by peer. This is typically caused by a remote worker hanging or bugs in the "
            "application. GLHF!"
        ),
        timeout,
        peer,
    )
    assert str(closed).endswith(
        "rank 2 (env 0) closed the connection: it exited first (its own line says why; a "
        "killed rank prints none) [Read error [127.0.0.1]:5256: Connection reset by peer]"
    )
    assert not closed.timed_out


def _describe(rank: int) -> str:
    return NAMES["split"][rank]


def test_first_cause_prefers_an_error_that_is_not_a_knock_on():
    own = Failure(0, COMM_ERROR_EXIT_CODE, 10.0, (2,))
    others = {
        3: Failure(3, USER_CODE_EXIT_CODE, 9.0),
        1: Failure(1, COMM_ERROR_EXIT_CODE, 9.5, (3,)),
        2: Failure(2, COMM_ERROR_EXIT_CODE, 9.6, (1,)),
    }
    assert first_cause(own, others, 4, _describe) == (
        "rank 3 (env 1) failed first (error in user code: see its line); the communication errors of ranks [0, 1, 2] "
        "follow from it"
    )


def test_first_cause_names_the_silent_rank_the_others_waited_on():
    # Inference stopped: the env ranks wait on it, the trainer waits on an env rank (a knock-on).
    own = Failure(0, COMM_ERROR_EXIT_CODE, 10.0, (2,), timed_out=True)
    others = {2: Failure(2, COMM_ERROR_EXIT_CODE, 10.1, (1,), True), 3: Failure(3, COMM_ERROR_EXIT_CODE, 10.1, (1,))}
    assert first_cause(own, others, 4, _describe).startswith(
        "rank 1 (inference 0) stopped responding first: ranks [2, 3] waited on it and it reported no error"
    )


def timed_out_on_rank_0(rank_2_at: float) -> dict[int, Failure]:
    """The other ranks' records when rank 0 was stopped: each timed out waiting on it (rank 1 on it alone)."""
    return {
        1: Failure(1, COMM_ERROR_EXIT_CODE, 10.2, (0,), True),
        2: Failure(2, COMM_ERROR_EXIT_CODE, rank_2_at, (0, 1, 3), True),
        3: Failure(3, COMM_ERROR_EXIT_CODE, 10.2, (0, 1, 2), True),
    }


def test_first_cause_names_a_resumed_rank_that_did_not_time_out_itself():
    # Rank 0 was stopped, then resumed: every other rank timed out on it; it found them gone.
    own = Failure(0, COMM_ERROR_EXIT_CODE, 14.0, (1,), timed_out=False)
    others = timed_out_on_rank_0(rank_2_at=10.2)
    assert first_cause(own, others, 4, _describe).startswith(
        "rank 0 (trainer 0) stopped responding first: ranks [1, 2, 3] timed out waiting on it"
    )


def test_failure_records_survive_the_store_as_plain_json():
    failure = Failure(2, 143, 1.5, (0, 1), True)
    assert Failure.decode(failure.encode()) == failure
    assert failure.kind == "stopped by SIGTERM"


def test_first_cause_names_a_resumed_rank_whose_own_deadline_passed_while_it_was_stopped():
    # Rank 0 was stopped longer than the timeout: resumed, its own wait has expired too, but long after the others'.
    own = Failure(0, COMM_ERROR_EXIT_CODE, 31.0, (1, 2, 3), timed_out=True)
    others = timed_out_on_rank_0(rank_2_at=10.3)
    assert first_cause(own, others, 4, _describe).startswith(
        "rank 0 (trainer 0) stopped responding first: ranks [1, 2, 3] timed out waiting on it"
    )


def test_first_cause_names_the_rank_that_says_it_did_not_run_during_its_wait():
    # Rank 0 was stopped and resumed at once after its peers timed out: its own failure comes only a moment after
    # theirs, but its watchdog saw 16 s without a tick.
    own = Failure(0, COMM_ERROR_EXIT_CODE, 10.4, (1, 2, 3), timed_out=True, frozen_s=16.0)
    others = timed_out_on_rank_0(rank_2_at=10.3)
    assert first_cause(own, others, 4, _describe).startswith(
        "rank 0 (trainer 0) stopped responding first: it did not run at all for 16 s"
    )


def test_the_watchdog_notices_that_its_process_was_stopped():
    from spmd_rl.runtime.watchdog import Watchdog

    dog = Watchdog()
    assert dog.frozen_for(60) == 0.0  # never started
    dog.configure(60.0, "rank 0")
    with dog.watch("a call"):
        time.sleep(0.6)
    assert dog.frozen_for(60) < 1.0
    dog._last_tick -= 5.0  # as if no tick had come for 5 s, and a SIGCONT had come since
    os.kill(os.getpid(), signal.SIGCONT)
    time.sleep(0.05)  # the handler runs at the next bytecode
    assert dog.frozen_for(60) > 4.0


def test_failure_records_in_the_launchers_directory_give_the_summary_without_rank_0(tmp_path, monkeypatch):
    # launch/mpirun.sh: mpirun killed rank 0 before its summary; the records the failing ranks left as files give
    # the same line, with the names of the silent ranks, once the launcher runs the module on the directory.
    monkeypatch.setenv("SPMD_RL_FAILURE_DIR", str(tmp_path))
    names = ["rank 0 (trainer 0)", "rank 1 (inference 0)", "rank 2 (env 0)", "rank 3 (env 1)"]
    for rank in (2, 3):
        after_failure(Failure(rank, COMM_ERROR_EXIT_CODE, 100.0 + rank, peers=(1,)), 4, names.__getitem__)
    assert sorted(path.name for path in tmp_path.iterdir()) == ["rank2.json", "rank3.json"]
    summarize = [sys.executable, "-m", "spmd_rl.runtime.postmortem", str(tmp_path)]
    done = subprocess.run(summarize, cwd=REPO, capture_output=True, text=True, timeout=60)
    # stdout: the job's exit code for the launcher (every record a communication error: 3)
    assert done.returncode == 0 and done.stdout == f"{COMM_ERROR_EXIT_CODE}\n", done
    assert done.stderr.splitlines() == [
        "spmd_rl: job summary: rank 1 (inference 0) stopped responding first: ranks [2, 3] waited on it and it "
        "reported no error (killed, stopped or hung); the other ranks' errors follow from it"
    ]
    assert (
        "torch"
        not in subprocess.run(
            [sys.executable, "-c", "import sys, spmd_rl.runtime.postmortem; print(sorted(sys.modules))"],
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=60,
        ).stdout
    )  # the launcher script runs it after every failure: no seconds-long import
    (tmp_path / SPOKEN_MARKER).touch()  # rank 0 printed the summary itself: the launcher adds none
    assert subprocess.run(summarize, cwd=REPO, capture_output=True, text=True, timeout=60).stderr == ""
