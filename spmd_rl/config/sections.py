"""The run's configuration sections. Every knob has one place: a field of a section dataclass below, with its
default, its allowed range and a help line (spmd_rl.config.loading checks every value against it).

Over 400 lines: every core knob lives here and nowhere else, so --help, the docs' key checks and a reader find
them in one file.
"""

from __future__ import annotations

import dataclasses
import hashlib
from dataclasses import dataclass, field
from typing import Any

import yaml


def knob(
    default,
    help: str,
    *,
    min=None,
    max=None,
    choices=None,
    item_min=None,
    item_max=None,
    factory=None,
    omit_default: bool = False,
):
    """A config field with its help text and its allowed values (item_min/item_max: bounds on a list's items).
    omit_default: the key is left out of config.yaml and the digests while it holds its default, so runs that do
    not use a feature added later keep their config.yaml and run directory."""
    meta = {"help": help, "min": min, "max": max, "choices": choices, "item_min": item_min, "item_max": item_max}
    if omit_default:
        meta["omit_default"] = True
    if factory is not None:
        return field(default_factory=factory, metadata=meta)
    return field(default=default, metadata=meta)


@dataclass
class RunSection:
    name: str = knob("ppo_cartpole", "run name; the default run directory is runs/<name>-<config digest>")
    dir: str = knob(
        "",
        "run directory (config.yaml, metrics.jsonl, TensorBoard events, policy, checkpoints); '' = the "
        "command's own: runs/<name>-<config digest>, then -2, -3, ... for later runs of that config; the same "
        "command continues the newest unless it finished",
    )
    resume: str = knob(
        "auto",
        "auto: a run directory with a checkpoint resumes from the latest one; never: refuse a "
        "run directory that holds a run (without run.dir: start a new one); or the path of a checkpoint (or of "
        "its run directory)",
    )
    init_from: str = knob(
        "",
        "start from trained weights: a run directory, a checkpoint, a policy.pt or a .safetensors file (fine-tune, "
        "pretrained weights); every key must fit the policy's names, shapes and dtypes",
    )
    init_prefix: str = knob(
        "",
        "with run.init_from: load the file into this submodule only, e.g. 'encoder.' (file key x = policy key "
        "encoder.x; the rest keeps its initialization); 'encoder.:backbone.' reads only the file's keys under "
        "backbone. (cut off) into policy.encoder",
        omit_default=True,
    )
    init_algorithm: bool = knob(
        False,
        "with run.init_from a checkpoint: also take the algorithm's state "
        "(optimizers, critics, ...), not only the policy",
    )
    stop_after_iterations: int = knob(
        0,
        "stop after this many iterations with a checkpoint (exit 75), as a signal "
        "would; rerun to continue (0 = run to the end)",
        min=0,
    )
    stop_at_return: float | None = knob(
        None,
        "finish early, with a checkpoint and exit 0, once the mean return of the last 20 episodes reaches this "
        "(null = run to the end)",
        omit_default=True,
    )


GROUP_NAME = r"[A-Za-z0-9_.-]{1,40}"  # an env group's name becomes part of metric keys (episode_return_mean/<name>)


@dataclass
class EnvGroup:
    """One group of envs in a multi-task run (env.groups): what it does not give, it takes from the env section."""

    name: str = knob("", "the group's name, unique: metric keys end in /<name> (letters, digits, _ . -)")
    id: str = knob("", "gymnasium id of this group's envs ('' = env.id)")
    kwargs: dict = knob(
        None, "keyword arguments merged over env.kwargs for this group (a key given here wins)", factory=dict
    )
    num_envs: int = knob(0, "this group's envs per env rank (0 = from total_envs, else env's count)", min=0)
    total_envs: int = knob(
        0, "this group's envs over all env ranks (must divide by the env ranks; wins over num_envs; 0 = unset)", min=0
    )


@dataclass
class EnvSection:
    id: str = knob("CartPole-v1", "gymnasium id, or 'package.module:EnvId' to import a user's env first")
    num_envs: int = knob(8, "environments per env rank (per rank in the colocated layout)", min=1)
    total_envs: int = knob(
        0,
        "environments over all env ranks: when set, it wins over env.num_envs, which becomes total_envs / env "
        "ranks (it must divide), so the global batch is the same at any world size; 0 = env.num_envs per rank",
        min=0,
    )
    kwargs: dict = knob(
        None, "keyword arguments passed to gymnasium.make (envpool.make with env.backend=envpool)", factory=dict
    )
    backend: str = knob(
        "gymnasium",
        "gymnasium: gymnasium's vector envs; envpool: EnvPool's C++ vectorized envs for the ids it provides (e.g. "
        'Breakout-v5; pip install -e ".[envpool]"); or package.module:Class, a spmd_rl.api.EnvBackend',
    )
    vectorization: str = knob(
        "auto",
        "auto: the env's own vectorized implementation if it has one, else sync",
        choices=["auto", "vector_entry_point", "sync", "async"],
    )
    start_method: str = knob(
        "auto",
        "env.vectorization=async: how the env worker processes start. auto: spawn for envs whose parent holds a GL "
        "context that a fork cannot carry (MetaWorld's), else the platform's default (fork on Linux); fork, spawn "
        "or forkserver: that one (spawn and forkserver re-import the main script and need its envs importable)",
        choices=["auto", "fork", "spawn", "forkserver"],
        omit_default=True,
    )
    normalize_reward: bool = knob(False, "scale rewards by a running estimate of the return's std (per env rank)")
    normalize_reward_gamma: float = knob(
        0.99,
        "env.normalize_reward: the discount of the return whose std scales the rewards (RL Zoo's VecNormalize uses "
        "the algorithm's gamma)",
        min=0.0,
        max=1.0,
        omit_default=True,
    )
    normalize_reward_reset: str = knob(
        "terminated",
        "env.normalize_reward: when the running discounted return restarts. terminated: at a termination only "
        "(gymnasium's NormalizeReward); done: after every episode end, truncations too (SB3's VecNormalize)",
        choices=["terminated", "done"],
        omit_default=True,
    )
    clip_reward: float = knob(
        0.0,
        "clip the (normalized, with env.normalize_reward) rewards to +-this (RL Zoo's VecNormalize: 10; 0 = no clip)",
        min=0.0,
        omit_default=True,
    )
    tokenizer: str = knob(
        "bytes",
        "text observations (gymnasium Text, alone or in a Dict): how a string becomes token ids on the env rank. "
        "bytes: its UTF-8 bytes (256 ids, no files); or a local tokenizer.json, or a folder holding one (a folder "
        "without one loads with transformers' AutoTokenizer); never fetched from a hub",
        omit_default=True,
    )
    max_text_tokens: int = knob(
        64,
        "text observations: the fixed length of the token ids and mask that travel (a longer text stops the run, "
        "naming the length it needs)",
        min=1,
        max=1_000_000,
        omit_default=True,
    )
    success_key: str = knob(
        "",
        "the key of the step info's success flag: success_rate (success at any step of an episode) and "
        "success_at_end_rate in the metrics, eval_success_rate in evaluations. '' = 'success' where the env's info "
        "has it (no success metrics otherwise); a key given here must be in the info",
        omit_default=True,
    )
    action_chunk: int = knob(
        1,
        "primitive env steps per policy decision: the policy's action is a chunk [K, *action shape] that the env "
        "rank executes step by step, stopping early where the episode ends (Box action spaces; env.backend "
        "gymnasium); env steps, train.total_steps and throughput count primitive steps",
        min=1,
        omit_default=True,
    )
    max_episode_steps: int = knob(
        0,
        "truncate every episode after this many primitive steps (a TimeLimit on each env; env.backend gymnasium); "
        "rollouts of whole episodes (an algorithm that asks for them, e.g. grpo) are ceil(this / env.action_chunk) "
        "decisions; 0 = the env's own step limit (env.kwargs' max_episode_steps, else its registration's)",
        min=0,
        omit_default=True,
    )
    group_size: int = knob(
        1,
        "envs that start together: an env rank's envs come in blocks of this many whose first reset takes the same "
        "seed, so each block starts from the same initial state (GRPO's groups); every env rank's env.num_envs (and "
        "every env.groups entry's) must be a multiple of it (env.backend gymnasium)",
        min=1,
        omit_default=True,
    )
    pipeline_stages: int = knob(
        1,
        "each env rank's envs in this many equal stages, stepped in turn, so that one stage steps while the "
        "inference rank acts for another (env and inference time overlap); in the colocated layout each stage "
        "steps on a thread of its own while the policy acts for the next, which needs env.vectorization=async; "
        "env.num_envs must be a multiple of it, and each stage of env.group_size's blocks; 1 = every env in one step",
        min=1,
        omit_default=True,
    )
    groups: list[EnvGroup] = knob(
        None,
        "env groups (multi-task): a list of {name, id, kwargs, num_envs, total_envs}; every env rank hosts every "
        "group, its envs the groups' envs in order; episode statistics are reported per group too ([] = one env)",
        factory=list,
    )

    def group_sections(self) -> list[tuple[str, EnvSection]]:
        """Each group as an env section of its own (no groups; id, kwargs and counts resolved against this one):
        [(name, section)], in order. Without groups: [] (the section is the one env)."""
        sections = []
        for group in self.groups:
            section = dataclasses.replace(
                self,
                id=group.id or self.id,
                kwargs={**self.kwargs, **group.kwargs},
                num_envs=group.num_envs or self.num_envs,  # per env rank, once the plan has resolved the counts
                total_envs=0,
                groups=[],
            )
            sections.append((group.name, section))
        return sections

    def group_names(self) -> list[str]:
        return [group.name for group in self.groups]


@dataclass
class EvalSection:
    every: int = knob(
        0,
        "evaluate the policy every N iterations on separate envs (0 = never); logged as "
        "eval_return_mean / eval_length_mean and printed on the console when it comes",
        min=0,
    )
    episodes: int = knob(10, "episodes per evaluation (dist.timeout_s bounds its time)", min=1, max=100_000)
    deterministic: bool = knob(True, "act with the policy's mode (argmax / mean) when evaluating")
    video_every: int = knob(
        0,
        "with eval.every: record one more episode, as video, at every Nth evaluation into <run dir>/videos/"
        "iter_<I>/ (0 = never; needs the video extra)",
        min=0,
        omit_default=True,
    )
    env: dict = knob(
        None,
        "env keys the evaluation changes (held-out settings): id, kwargs (replacing env.kwargs), groups (replacing "
        "env.groups); {} = evaluate on the training env; with groups, eval.episodes per group",
        factory=dict,
    )


@dataclass
class CheckpointSection:
    every_iterations: int = knob(
        0, "checkpoint every N iterations (0 = by time only); always after the last one", min=0
    )
    every_s: float = knob(
        600.0,
        "checkpoint when this many seconds passed since the last one (rank 0's clock, "
        "agreed by all ranks; 0 = never by time)",
        min=0.0,
    )
    keep: int = knob(2, "complete checkpoints kept (older ones are deleted)", min=1)
    keep_best: bool = knob(
        False,
        "with eval.every: after every evaluation whose eval_return_mean beats the best so far, write "
        "best/policy.pt and best/score.json in the run directory",
    )


@dataclass
class AlgorithmConfig:
    """The keys every algorithm has: its own Config subclasses this (spmd_rl.api re-exports it)."""

    num_steps: int = knob(32, "steps per environment in one rollout (one iteration)", min=1)


@dataclass
class NoConfig:
    """The config of a plug-in class that has no keys of its own."""


@dataclass
class BufferSection:
    capacity: int = knob(1_000_000, "replay capacity in transitions per trainer shard", min=1, max=10**9)
    backend: str = knob(
        "memory", "replay storage: memory, or hdf5 (bounded memory, survives restarts)", choices=["memory", "hdf5"]
    )
    chunk_rows: int = knob(
        0,
        "HDF5 rows per chunk (appends are batched to whole chunks); 0 = automatic: ~1 MiB "
        "of rows, or the existing file's",
        min=0,
        max=2**22,
    )
    compression: str = knob("none", "HDF5 compression (fast codecs only)", choices=["none", "lzf"])
    log_experience: bool = knob(False, "append every collected rollout to <run dir>/buffer/experience_rank<R>.h5")
    flush_every_s: float = knob(
        2.0,
        "HDF5 files (experience log, hdf5 replay): rows staged in memory are written "
        "within this many seconds of being added (what kill -9 can lose); 0 = on every "
        "append",
        min=0.0,
    )

    @property
    def h5_compression(self) -> str | None:
        """The compression argument for h5py (None for "none")."""
        return None if self.compression == "none" else self.compression


@dataclass
class TrainSection:
    total_steps: int = knob(100_000, "budget in env steps, summed over all env ranks", min=1, max=10**12)
    seed: int = knob(
        1, "seeds torch, numpy and the environments (each rank offsets it by its rank)", min=0, max=2**32 - 1
    )
    torch_threads: int = knob(1, "torch intra-op threads per rank", min=1, max=1024)
    device: str = knob(
        "auto",
        "auto: trainer and inference ranks (every colocated rank) on a GPU of their own when CUDA is available, env "
        "ranks on the CPU; else cpu",
        choices=["auto", "cpu", "cuda"],
    )
    deterministic: bool = knob(
        False,
        "torch.use_deterministic_algorithms on every rank (and cuBLAS's fixed workspace): on GPUs, runs that repeat "
        "and resume exactly, at some speed; CPU runs are deterministic already",
    )
    skip_nonfinite_updates: bool = knob(
        False,
        "an update whose loss or policy weights come out NaN/inf is undone "
        "and counted (metric nonfinite_updates_skipped) instead of ending "
        "the run with exit code 4",
    )
    parallel: str = knob(
        "ddp",
        "how trainers share the policy: ddp (every trainer a full replica) or fsdp (FSDP2: parameters, "
        "gradients and optimizer state sharded over the trainers; sharded checkpoints)",
        choices=["ddp", "fsdp"],
        omit_default=True,
    )
    shard_group_size: int = knob(
        0,
        "with train.parallel=fsdp: hybrid sharding: shard within groups of this many trainers and replicate across "
        "the groups (gradients are all-reduced between replicas); 0 = shard over all trainers",
        min=0,
        omit_default=True,
    )
    precision: str = knob(
        "fp32",
        "fp32, or bf16: the policy's forward and backward compute in bfloat16 while the master weights, the "
        "optimizer state, the gradient reduction and the loss math stay float32",
        choices=["fp32", "bf16"],
        omit_default=True,
    )
    activation_checkpointing: bool = knob(
        False,
        "recompute each shard unit's activations in the backward pass instead of keeping them (less memory, more "
        "compute); the units are the policy's shard_units()",
        omit_default=True,
    )


@dataclass
class LayoutSection:
    mode: str = knob(
        "colocated",
        "colocated: every rank plays every role; split: ranks divided into roles",
        choices=["colocated", "split"],
    )
    trainer: int = knob(0, "split: trainer ranks (-1 = the rest)", min=-1)
    inference: int = knob(0, "split: inference ranks (-1 = the rest)", min=-1)
    env: int = knob(0, "split: env ranks (-1 = the rest)", min=-1)


@dataclass
class DistSection:
    timeout_s: float = knob(
        300.0, "bound on every wait between ranks; an expired wait fails the job", min=0.001, max=7 * 24 * 3600.0
    )


@dataclass
class WeightsSection:
    bucket_mb: float = knob(64.0, "size of one flat weight bucket broadcast to inference ranks", min=0.001)
    verify_every: int = knob(10, "compare weight checksums across the weight group every N syncs (0 = never)", min=0)


@dataclass
class InferenceSection:
    dtype: str = knob(
        "fp32",
        "the inference ranks' copy of the policy and the weights on the wire: fp32, or bf16 (half the bytes; "
        "floating-point parameters only, buffers such as normalizer statistics keep their dtype)",
        choices=["fp32", "bf16"],
        omit_default=True,
    )


@dataclass
class LogSection:
    progress: bool | None = knob(None, "progress bar on rank 0: true, false, or null = only on a terminal")
    interval_s: float = knob(5.0, "seconds between printed progress lines", min=0.0)
    tensorboard: bool = knob(True, "write TensorBoard event files to the run directory")
    wandb: bool = knob(False, 'also log the scalars and the config to Weights & Biases (pip install -e ".[wandb]")')
    wandb_project: str = knob("spmd_rl", "the W&B project")
    wandb_mode: str = knob("online", "W&B mode (WANDB_MODE wins when set)", choices=["online", "offline", "disabled"])
    mlflow: bool = knob(False, 'also log the scalars and the config to MLflow (pip install -e ".[mlflow]")')
    mlflow_tracking_uri: str = knob("", "MLflow tracking URI; '' = MLFLOW_TRACKING_URI or MLflow's default")
    mlflow_experiment: str = knob("spmd_rl", "the MLflow experiment")


PLUGIN_SECTIONS = ("algo", "policy", "engine")  # each names a class (`class: module:Class`) and holds its keys


@dataclass
class Config:
    run: RunSection = field(default_factory=RunSection)
    env: EnvSection = field(default_factory=EnvSection)
    # The plug-in sections hold an instance of the named class's own Config dataclass; `classes` records which
    # class each names (section -> alias or module:Class), and `callbacks` is a list of (class, config) pairs.
    algo: Any = None
    policy: Any = None
    engine: Any = None
    callbacks: list = field(default_factory=list)
    buffer: BufferSection = field(default_factory=BufferSection)
    train: TrainSection = field(default_factory=TrainSection)
    layout: LayoutSection = field(default_factory=LayoutSection)
    dist: DistSection = field(default_factory=DistSection)
    weights: WeightsSection = field(default_factory=WeightsSection)
    inference: InferenceSection = field(default_factory=InferenceSection)
    log: LogSection = field(default_factory=LogSection)
    checkpoint: CheckpointSection = field(default_factory=CheckpointSection)
    eval: EvalSection = field(default_factory=EvalSection)
    classes: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        """The resolved config as plain data: what config.yaml holds and what --config reads back."""
        out: dict[str, Any] = {}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.name == "classes":
                continue
            if f.name in PLUGIN_SECTIONS:
                out[f.name] = {"class": self.classes[f.name], **dataclasses.asdict(value)}
            elif f.name == "callbacks":
                out[f.name] = [{"class": name, **dataclasses.asdict(config)} for name, config in value]
            else:
                out[f.name] = dataclasses.asdict(value)
        # Keys of features a run does not use are left out, so such a run's config.yaml and digest (its run
        # directory) stay what they were before the feature existed.
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if dataclasses.is_dataclass(value) and f.name in out:
                for key in _omitted_defaults(value):
                    del out[f.name][key]
            if f.name == "callbacks":
                for entry, (_, config) in zip(out[f.name], value):
                    for key in _omitted_defaults(config):
                        del entry[key]
        if not out["inference"]:
            del out["inference"]
        if not out["env"]["groups"]:
            del out["env"]["groups"]
        if not out["eval"]["env"]:
            del out["eval"]["env"]
        return out

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.to_dict(), sort_keys=False)

    def digest(self) -> str:
        """A hash of the resolved config; every rank compares it with rank 0's."""
        return hashlib.sha256(yaml.safe_dump(self.to_dict(), sort_keys=True).encode()).hexdigest()

    def resume_dict(self, with_layout: bool = True) -> dict:
        """What a resumed run must share with the run it continues: everything but where and how it is run (run,
        checkpoint, log) and the bound on waits (without_layout: the layout too, for a resharded resume)."""
        data = {k: v for k, v in self.to_dict().items() if k not in ("run", "checkpoint", "log")}
        data["dist"] = {k: v for k, v in data["dist"].items() if k != "timeout_s"}
        if not with_layout:  # the per-rank env counts follow from env.total_envs and the layout
            del data["layout"]
            if data["env"].get("total_envs"):
                data["env"] = {k: v for k, v in data["env"].items() if k != "num_envs"}
        return data

    def resume_digest(self, with_layout: bool = True) -> str:
        """A hash of resume_dict()."""
        return hashlib.sha256(yaml.safe_dump(self.resume_dict(with_layout), sort_keys=True).encode()).hexdigest()


def _omitted_defaults(section) -> list[str]:
    """The keys of a section (or a plug-in's Config) marked omit_default that hold their default."""
    omitted = []
    for f in dataclasses.fields(section):
        if not f.metadata.get("omit_default"):
            continue
        # f.default_factory is typed with MISSING's type too: it is a factory whenever there is no default
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()  # type: ignore[operator]
        if getattr(section, f.name) == default:
            omitted.append(f.name)
    return omitted
