"""The Engine contract: the loops one rank runs for the whole run."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, ClassVar

from spmd_rl.config.sections import NoConfig

if TYPE_CHECKING:  # annotations only: the run and its components are built above this layer
    from spmd_rl.interfaces.policy import Policy


class Engine:
    """The loops of one run on this rank, chosen by `engine.class` (built-ins: `sync`, spmd_rl.engines.sync;
    `async`, spmd_rl/engines/asynchronous/). Subclass it and set `Config` to a dataclass of your keys; to keep the
    sync engine's loops and add to them, subclass spmd_rl.api.SyncEngine (or AsyncEngine, its subclass) and
    override its hooks (after_learn, before_sync, components) instead.

    `run(run)` receives a spmd_rl.api.Run and typically reads `run.role` (COLOCATED, or ENV / INFERENCE / TRAINER
    in the split layout) and runs one loop per role over `run.iterations`:
      - build the role's component: `run.build_colocated(logger)` -> (EnvRunner, or a PipelinedEnvRunner with
        env.pipeline_stages; InferenceServer, Trainer, Reporter); `run.build_env_runner()`;
        `run.build_inference_server()` (or `run.inference_parts()` for a server of your own);
        `run.build_trainer(logger)` -> (Trainer, Reporter);
      - restore them, `run.restore(components)` with `{name: component}` (each has state_dict() and
        load_state_dict(state); the role components' names are in spmd_rl/persist/rank_state.py), before the
        first iteration: the checkpoint the run resumes from, if any, is loaded into them;
      - call their step-level methods (EnvRunner.collect_segment, or collect_segment_in_process with the server's
        serve_stage in one process; InferenceServer.serve_step / take_weights,
        Trainer.receive_segments / learn / publish_weights / gather_statistics), following `run.plan`
        (version_at, syncs_after, explores_at);
      - end every iteration with `run.end_iteration(iteration, components)` on every rank after the same
        iterations (checkpoints and stops are agreed there; a checkpoint saves the same components' states).
    Wrap the loop in `run.with_metrics(lambda logger: ...)`: rank 0 gets the MetricsLogger, others None. Every
    rank's sends and receives must follow from the plan alone, as in the built-in engines.

    `check_plan(cfg, topology, plan, schedule)` (a classmethod, optional) may refuse a layout or schedule before
    any process group exists, with a spmd_rl.api.UserError."""

    Config: ClassVar[type] = NoConfig

    @classmethod
    def asked_policy_lag(cls, config: Any) -> int | None:
        """The policy lag this engine's config asks to act with (PlanFacts.asked_policy_lag, so an algorithm's
        check_plan can say what of its own would tolerate it); None: no more than the algorithm's schedule."""
        return None

    def __init__(self, config: Any) -> None:
        self.config = config

    def run(self, run: Any) -> Policy | None:
        """Run this rank's role for the whole run; return the policy (trainer rank 0's is saved)."""
        raise NotImplementedError
