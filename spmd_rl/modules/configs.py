"""The built-in policies' own config sections (`policy:` in YAML), kept free of torch (see algorithms/configs.py)."""

from __future__ import annotations

from dataclasses import dataclass

from spmd_rl.config.sections import knob


def _temperature_knob():
    """policy.temperature, the same key with the same meaning on every built-in policy that samples."""
    return knob(
        1.0,
        "rollout sampling temperature: a Gaussian's std times it, a categorical's (or each bin's) logits divided by "
        "it; act's and evaluate's log-probs are the tempered distribution's (1 = the policy as trained)",
        min=0.01,
        omit_default=True,
    )


@dataclass
class EncoderConfig:
    """The observation encoder's keys (modules/encoders.py), shared by the policies built on it (the actor-critic
    and the Q-network): an MLP for vector observations, a CNN for images. A subclass sets its own defaults by
    declaring a key again."""

    normalize_obs: bool = knob(False, "running normalization of vector observations (merged across trainers)")
    encoder: str = knob(
        "auto",
        "auto: an MLP for vector observations, a CNN for images (uint8 HxWxC or CxHxW); or force mlp (flattens) or cnn",
        choices=["auto", "mlp", "cnn"],
    )
    cnn: str = knob(
        "small",
        "CNN encoder preset: small (3x3 convs, stride 1 then 2, channels 16 32, padded; 256 features) or nature "
        "(the DQN paper's 8x8 stride 4, 4x4 stride 2, 3x3 stride 1, channels 32 64 64, unpadded; 512 features)",
        choices=["small", "nature"],
    )
    cnn_channels: list[int] = knob(
        None, "CNN encoder: output channels of each conv layer ([] = the preset's)", factory=list, item_min=1
    )
    cnn_kernels: list[int] = knob(
        None, "CNN encoder: kernel size of each conv layer ([] = the preset's)", factory=list, item_min=1
    )
    cnn_strides: list[int] = knob(
        None, "CNN encoder: stride of each conv layer ([] = the preset's)", factory=list, item_min=1
    )
    cnn_features: int = knob(
        0, "CNN encoder: width of the linear layer after the convolutions (0 = the preset's)", min=0
    )
    text_embedding: int = knob(
        32,
        "text observations: width of the token embedding whose mean over the text's tokens is its feature",
        min=1,
        omit_default=True,
    )
    cnn_init: str = knob(
        "auto",
        "CNN encoder initialization: auto (orthogonal for the nature preset, torch's default for small), orthogonal "
        "(gain sqrt(2), zero biases: the PPO recipe) or default (torch's Conv2d/Linear init, as SB3's and CleanRL's "
        "DQN keep it)",
        choices=["auto", "orthogonal", "default"],
        omit_default=True,
    )


@dataclass
class ActorCriticConfig(EncoderConfig):
    """The built-in actor-critic: an encoder per observation (MLP for vectors, CNN for images), then actor and
    critic heads."""

    hidden_sizes: list[int] = knob(
        None, "hidden layer widths of the actor and the critic MLPs", factory=lambda: [64, 64], item_min=1
    )
    activation: str = knob("tanh", "hidden activation", choices=["tanh", "relu", "elu"])
    log_std_init: float = knob(0.0, "initial log std of the Gaussian policy (continuous actions)")
    ortho_init: bool = knob(
        True,
        "orthogonal initialization of the actor and critic MLPs (gain sqrt(2), heads 0.01 and 1, zero biases); "
        "false: torch's default nn.Linear initialization (SB3's ortho_init=False)",
        omit_default=True,
    )
    action_bins: int = knob(
        0,
        "Box actions as bins (as OpenVLA's action tokens): one categorical over this many evenly spaced values "
        "from low to high per action element (and chunk step); 0 = a Gaussian (bounds must be finite to bin)",
        min=0,
        omit_default=True,
    )
    temperature: float = _temperature_knob()


@dataclass
class BoundedActorConfig:
    """The MLP knobs SAC's and TD3's actors share (modules/sac_td3_networks.py BoundedActor)."""

    hidden_sizes: list[int] = knob(None, "hidden layer widths of the actor MLP", factory=lambda: [256, 256], item_min=1)
    activation: str = knob("relu", "hidden activation", choices=["tanh", "relu", "elu"])
    normalize_obs: bool = knob(False, "running observation normalization (merged across trainers)")


@dataclass
class SquashedGaussianConfig(BoundedActorConfig):
    """SAC's actor: an MLP giving a tanh-squashed Gaussian over actions."""


@dataclass
class DeterministicActorConfig(BoundedActorConfig):
    """TD3's actor: an MLP giving a deterministic tanh-bounded action; acting adds Gaussian exploration noise."""

    exploration_noise: float = knob(
        0.1,
        "std of the Gaussian noise acting adds to the action, in units of the action's half-range (the action "
        "then clipped to the bounds; none when deterministic, as in evaluation)",
        min=0.0,
    )


@dataclass
class TransformerConfig:
    """The built-in transformer (`policy.class: transformer`): observations as tokens, a pre-norm transformer
    encoder, and actor and critic heads on a readout token. The defaults are small (~0.1M parameters, for CPU);
    ~1B parameters is width 2048, depth 20, heads 16 (a GPU; see docs/plugins.md)."""

    width: int = knob(64, "token width (the model dimension)", min=1)
    depth: int = knob(2, "number of transformer blocks (each one FSDP shard unit)", min=1)
    heads: int = knob(4, "attention heads per block (must divide width)", min=1)
    mlp_ratio: float = knob(4.0, "width of each block's MLP as a multiple of width", min=0.0)
    vector_tokens: int = knob(
        1,
        "tokens a vector observation becomes: its flattened features in that many equal contiguous groups (must "
        "divide the feature count), each group with its own linear embedding",
        min=1,
    )
    patch_size: int = knob(
        8, "image observations: side of the square patches, one token each (zero-padded to a multiple)", min=1
    )
    normalize_obs: bool = knob(False, "running normalization of vector observations (merged across trainers)")
    log_std_init: float = knob(0.0, "initial log std of the Gaussian policy (continuous actions)")
    temperature: float = _temperature_knob()


@dataclass
class QNetworkConfig(EncoderConfig):
    """DQN's Q-network (`policy.class: q_network`): the actor-critic's observation encoder (an MLP for vectors, a
    CNN for images), then an MLP giving Q(s, a) for every discrete action; act is epsilon-greedy."""

    hidden_sizes: list[int] = knob(
        None, "hidden layer widths of the Q MLP (SB3's DQN default)", factory=lambda: [64, 64], item_min=1
    )
    activation: str = knob("relu", "hidden activation", choices=["tanh", "relu", "elu"])
    cnn: str = knob(
        "nature",
        "CNN encoder preset (see policy.cnn of the actor-critic): small or nature",
        choices=["small", "nature"],
    )


@dataclass
class LoraConfig:
    """LoRA adapters through peft (`policy.lora`): rank 0 trains the whole policy."""

    rank: int = knob(0, "LoRA rank r (0 = no adapters: every weight trains)", min=0)
    alpha: float = knob(16.0, "LoRA alpha: the adapters' output is scaled by alpha / rank", min=0.0)
    dropout: float = knob(
        0.0,
        "dropout on the adapters' input (acting and learning draw different masks: PPO's first ratio is 1 only with 0)",
        min=0.0,
        max=1.0,
    )
    target_modules: list[str] = knob(
        None,
        "names (or name suffixes) of the backbone's Linear layers that get adapters; each must match at least one",
        factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj"],
    )
    save: str = knob(
        "merged",
        "what policy.pt holds: merged (the adapters folded into the base weights: a plain policy without LoRA) or "
        "adapters (only what trains: adapters, heads, log std; the frozen base comes from policy.pretrained)",
        choices=["merged", "adapters"],
    )


@dataclass
class VLAConfig:
    """The built-in vision-language-action policy (`policy.class: vla`, modules/vla.py): camera images through a
    SigLIP vision encoder, the instruction's tokens and a state token into a Gemma decoder, an action chunk out (a
    Gaussian, or 256 bins per dimension on the vocabulary's last ids), and a value head for PPO."""

    pretrained: str = knob(
        "",
        "a local transformers PaliGemma folder (config.json, model.safetensors or sharded with "
        "model.safetensors.index.json); '' = the preset, randomly initialized",
        omit_default=True,
    )
    preset: str = knob(
        "tiny",
        "size when policy.pretrained is '': tiny (~5M parameters, tests), small (~100M, CPU benchmarks), base "
        "(~3B, PaliGemma-3B's shapes; a GPU)",
        choices=["tiny", "small", "base"],
    )
    image_keys: list[str] = knob(
        None, "the Dict observation's camera images (uint8, HxWxC or CxHxW; any size)", factory=lambda: ["image"]
    )
    state_key: str = knob("state", "the Dict observation's proprioceptive state vector ('' = none)")
    instruction_key: str = knob(
        "instruction",
        "the Dict observation's instruction: token ids and their mask under <key>/ids and <key>/mask, as text "
        "observations arrive ('' = none)",
    )
    action_head: str = knob(
        "gaussian",
        "gaussian: a diagonal Gaussian over the chunk (state-independent log std); bins: 256 bins per action "
        "dimension, their logits the language head's on the vocabulary's last 256 ids (OpenVLA)",
        choices=["gaussian", "bins"],
    )
    log_std_init: float = knob(0.0, "initial log std of the Gaussian head")
    temperature: float = _temperature_knob()
    lora: LoraConfig = knob(
        None, "LoRA adapters through peft: {rank, alpha, dropout, target_modules, save}", factory=LoraConfig
    )
