"""The built-in algorithms' own config sections (`algo:` in YAML), kept free of torch so that `--help` and config
errors answer without importing it. PPO.Config is PPOConfig, SAC.Config is SACConfig (and so on)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from spmd_rl.config.sections import AlgorithmConfig, knob
from spmd_rl.runtime.errors import UserError


def check_num_minibatches(num_minibatches: int, available: int, what: str, advice: str = "lower it") -> None:
    """algo.num_minibatches splits what a trainer learns from in an iteration: no more parts than there are items
    (`what` names them)."""
    if available < num_minibatches:
        raise UserError(
            f"algo.num_minibatches={num_minibatches} is more than the {available} {what} per iteration; {advice}"
        )


@dataclass
class PPOConfig(AlgorithmConfig):
    """PPO's hyperparameters; the defaults are RL Zoo's tuned CartPole-v1 settings with 2 minibatches instead of 1."""

    default_policy: ClassVar[str] = "actor_critic"
    learning_rate: float = knob(1e-3, "Adam learning rate", min=0.0)
    anneal_lr: bool = knob(True, "anneal the learning rate linearly to 0 over the run")
    gamma: float = knob(0.98, "discount factor", min=0.0, max=1.0)
    gae_lambda: float = knob(0.8, "GAE lambda", min=0.0, max=1.0)
    num_minibatches: int = knob(2, "minibatches per epoch (each trainer splits its share of the batch)", min=1)
    update_epochs: int = knob(20, "passes over the rollout per iteration", min=1)
    clip_coef: float = knob(0.2, "PPO clipping coefficient", min=0.0)
    anneal_clip: bool = knob(True, "anneal the clipping coefficient linearly to 0 over the run")
    clip_value_loss: bool = knob(False, "clip the value loss around the old values")
    ent_coef: float = knob(0.0, "entropy bonus coefficient", min=0.0)
    vf_coef: float = knob(0.5, "value loss coefficient", min=0.0)
    max_grad_norm: float = knob(0.5, "gradient norm clipping", min=0.0)
    normalize_advantages: bool = knob(True, "normalize advantages per minibatch")
    target_kl: float | None = knob(None, "stop the epochs early when approx_kl exceeds this (null = never)", min=0.0)
    micro_batch_size: int = knob(
        0,
        "run each minibatch's forward and backward in parts of at most this many samples, gradients accumulated, "
        "then one clip and optimizer step: the same step with less activation memory (0 = the whole minibatch)",
        min=0,
        omit_default=True,
    )
    vtrace: bool = knob(
        False,
        "V-trace targets and advantages (off-policy correction for the async engine's policy "
        "lag); declares a tolerated lag of 8 versions (0 without)",
    )
    vtrace_rho_bar: float = knob(
        1.0, "V-trace: truncation of the importance weights rho (advantages, targets)", min=0.0
    )
    vtrace_c_bar: float = knob(
        1.0, "V-trace: truncation of the trace-cutting weights c (gae_lambda scales them)", min=0.0
    )


@dataclass
class GRPOConfig(AlgorithmConfig):
    """GRPO's hyperparameters; the clip, KL and filtering defaults are SimpleVLA-RL's recipe (clip-higher 0.2 / 0.28,
    no KL term). algo.num_steps is not used: a rollout is whole episodes (env.max_episode_steps)."""

    default_policy: ClassVar[str] = "actor_critic"
    learning_rate: float = knob(3e-4, "Adam learning rate", min=0.0)
    update_epochs: int = knob(4, "passes over the rollout per iteration", min=1)
    num_minibatches: int = knob(1, "minibatches per epoch (each trainer splits its share of the batch)", min=1)
    clip_low: float = knob(0.2, "the ratio's lower clip: 1 - clip_low", min=0.0)
    clip_high: float = knob(0.28, "the ratio's upper clip: 1 + clip_high (clip-higher: above clip_low)", min=0.0)
    kl_coef: float = knob(
        0.0, "weight of the KL to the frozen initial policy (k3 estimator); 0 = no reference policy is kept", min=0.0
    )
    ent_coef: float = knob(0.0, "entropy bonus coefficient", min=0.0)
    max_grad_norm: float = knob(1.0, "gradient norm clipping", min=0.0)
    std_eps: float = knob(1e-6, "added to a group's outcome std in the advantage's denominator", min=0.0)
    filter_groups: bool = knob(
        False, "dynamic sampling: drop the groups whose outcomes are all equal (they carry no signal)"
    )
    max_resample_rounds: int = knob(
        0,
        "dynamic sampling's refill (with filter_groups; one process and the colocated layout): roll up to this many "
        "extra rollouts in an iteration, adding their informative groups, until the batch holds as many groups as "
        "one rollout has",
        min=0,
        omit_default=True,
    )
    outcome: str = knob(
        "auto",
        "an episode's outcome, which its group compares: success (1 if the env's success flag was set at any of its "
        "steps, else 0; the env must report env.success_key), return (its undiscounted return) or auto (success "
        "where the env reports a success flag, else return)",
        choices=["auto", "success", "return"],
        omit_default=True,
    )


@dataclass
class SACConfig(AlgorithmConfig):
    """SAC's hyperparameters (CleanRL's sac_continuous_action defaults) and its critics' shape."""

    default_policy: ClassVar[str] = "squashed_gaussian"
    num_steps: int = knob(8, "env steps per segment an env rank streams to its trainer's replay shard", min=1)
    gamma: float = knob(0.99, "discount factor", min=0.0, max=1.0)
    tau: float = knob(0.005, "Polyak averaging rate of the target critics", min=0.0, max=1.0)
    batch_size: int = knob(256, "sampled transitions per gradient step, all trainers together", min=1)
    learning_starts: int = knob(5000, "env steps (all env ranks) of uniform random actions before learning", min=0)
    updates_per_step: float = knob(1.0, "gradient steps per env step (all env ranks together)", min=0.0)
    policy_lr: float = knob(3e-4, "actor (and entropy temperature) learning rate", min=0.0)
    q_lr: float = knob(1e-3, "critic learning rate", min=0.0)
    policy_frequency: int = knob(2, "update the actor every N critic updates (N times, TD3-style delay)", min=1)
    target_network_frequency: int = knob(1, "Polyak-update the target critics every N critic updates", min=1)
    alpha: float = knob(0.2, "entropy temperature (initial value when autotune)", min=0.0)
    autotune: bool = knob(True, "tune the temperature towards the target entropy -|A|")
    weight_sync_every: int = knob(1, "iterations between weight broadcasts to the inference ranks", min=1)
    micro_batch_size: int = knob(
        0,
        "run each gradient step's forward and backward in parts of at most this many transitions (of this "
        "trainer's share of algo.batch_size), gradients accumulated: the same step with less activation memory "
        "(0 = the whole batch)",
        min=0,
        omit_default=True,
    )
    critic_hidden_sizes: list[int] = knob(
        None, "hidden layer widths of each Q network", factory=lambda: [256, 256], item_min=1
    )
    critic_activation: str = knob("relu", "hidden activation of the Q networks", choices=["tanh", "relu", "elu"])

    def __post_init__(self):
        if self.autotune and self.alpha <= 0:
            raise UserError(
                f"algo.alpha={self.alpha} with algo.autotune=true: the temperature is tuned in log space "
                "from its initial value algo.alpha, which must be > 0"
            )


@dataclass
class DQNConfig(AlgorithmConfig):
    """DQN's hyperparameters (the defaults are Stable-Baselines3 DQN's, with Double DQN on): a Q-network policy
    (epsilon-greedy act), a target network, Huber loss on n-step TD targets from the replay buffer."""

    default_policy: ClassVar[str] = "q_network"
    num_steps: int = knob(
        4, "env steps per segment an env rank streams to its trainer's replay shard (SB3's train_freq)", min=1
    )
    gamma: float = knob(0.99, "discount factor", min=0.0, max=1.0)
    learning_rate: float = knob(1e-4, "Adam learning rate", min=0.0)
    batch_size: int = knob(32, "sampled transitions per gradient step, all trainers together", min=1)
    learning_starts: int = knob(100, "env steps (all env ranks) of uniform random actions before learning", min=0)
    updates_per_step: float = knob(
        0.25, "gradient steps per env step, all env ranks together (SB3's gradient_steps / train_freq)", min=0.0
    )
    target_update_interval: int = knob(
        10000, "env steps (all env ranks) between target network updates (counted as SB3 counts them)", min=1
    )
    tau: float = knob(1.0, "target update rate: 1 = a hard copy, < 1 = Polyak averaging", min=0.0, max=1.0)
    double: bool = knob(True, "Double DQN: the online network picks the next action, the target network values it")
    n_step: int = knob(1, "n-step returns (shorter where an episode or the segment ends first)", min=1)
    exploration_fraction: float = knob(
        0.1, "fraction of train.total_steps over which epsilon falls linearly to its final value", min=0.0, max=1.0
    )
    exploration_initial_eps: float = knob(1.0, "epsilon at the start", min=0.0, max=1.0)
    exploration_final_eps: float = knob(0.05, "epsilon after exploration_fraction of the run", min=0.0, max=1.0)
    max_grad_norm: float = knob(10.0, "gradient norm clipping (0 = none)", min=0.0)
    weight_sync_every: int = knob(1, "iterations between weight broadcasts to the inference ranks", min=1)


@dataclass
class TD3Config(AlgorithmConfig):
    """TD3's hyperparameters (Fujimoto et al. 2018; the defaults are Stable-Baselines3 TD3's) and its critics' shape:
    a deterministic actor (exploration noise: policy.exploration_noise), twin critics, target policy smoothing and
    delayed actor and target updates."""

    default_policy: ClassVar[str] = "deterministic_actor"
    num_steps: int = knob(8, "env steps per segment an env rank streams to its trainer's replay shard", min=1)
    gamma: float = knob(0.99, "discount factor", min=0.0, max=1.0)
    tau: float = knob(0.005, "Polyak averaging rate of the target actor and the target critics", min=0.0, max=1.0)
    batch_size: int = knob(256, "sampled transitions per gradient step, all trainers together", min=1)
    learning_starts: int = knob(100, "env steps (all env ranks) of uniform random actions before learning", min=0)
    updates_per_step: float = knob(1.0, "critic gradient steps per env step (all env ranks together)", min=0.0)
    policy_lr: float = knob(1e-3, "actor learning rate", min=0.0)
    q_lr: float = knob(1e-3, "critic learning rate", min=0.0)
    policy_delay: int = knob(
        2, "one actor step and one Polyak update of the targets every N critic steps (delayed updates)", min=1
    )
    target_policy_noise: float = knob(
        0.2, "std of the target policy smoothing noise, in units of the action's half-range", min=0.0
    )
    target_noise_clip: float = knob(
        0.5, "the smoothing noise clipped to +- this, in units of the action's half-range", min=0.0
    )
    weight_sync_every: int = knob(1, "iterations between weight broadcasts to the inference ranks", min=1)
    critic_hidden_sizes: list[int] = knob(
        None, "hidden layer widths of each Q network", factory=lambda: [256, 256], item_min=1
    )
    critic_activation: str = knob("relu", "hidden activation of the Q networks", choices=["tanh", "relu", "elu"])


@dataclass
class BCConfig(AlgorithmConfig):
    """Behaviour cloning (supervised fine-tuning) on demonstrations: the negative log-likelihood of each demonstrated
    action (or action chunk) under the policy; cross-entropy for a discrete or binned head. No rollouts: an
    iteration is update_epochs passes over the demonstrations in minibatches of batch_size decisions (algo.num_steps
    and train.total_steps are not used). docs/sft.md."""

    default_policy: ClassVar[str] = "actor_critic"
    demos: str = knob(
        "", "the demonstrations: an HDF5 experience file, a folder of them (or a run directory's buffer/) or a glob"
    )
    iterations: int = knob(100, "iterations of the run (each update_epochs passes over the demonstrations)", min=1)
    update_epochs: int = knob(1, "passes over the demonstrations per iteration", min=1)
    batch_size: int = knob(256, "decisions per gradient step, all trainers together (each takes an equal part)", min=1)
    learning_rate: float = knob(3e-4, "Adam learning rate", min=0.0)
    max_grad_norm: float = knob(1.0, "gradient norm clipping (0 = none)", min=0.0)
