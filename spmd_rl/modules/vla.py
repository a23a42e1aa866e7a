"""The built-in vision-language-action policy (`policy.class: vla`): a PaliGemma-style backbone from transformers
(a SigLIP vision encoder, a linear projector, a Gemma decoder), built from a size preset or read from a local
model folder (`policy.pretrained`, modules/pretrained.py), with action heads for RL.

One forward pass per decision. The decoder reads, in order: each camera image's patch tokens (resized and
normalized to what the vision config expects, as the model's processor would), the instruction's token ids
(padding masked out), one state token (a linear map of the state vector) and K x A learned action queries, one
per action dimension of the chunk (K = env.action_chunk, whose actions arrive as a Box [K, A]; A = the action
space's size). Every query's final
hidden state gives its dimension's action, all in parallel (no autoregressive decoding):
- gaussian: a linear map to the mean, a state-independent log std per dimension;
- bins: the language head's logits on the vocabulary's last 256 ids, one bin each, spread evenly over the
  action space's bounds (OpenVLA's action tokens).
The last query's hidden state also gives the value (PPO's critic). The outputs and methods are the actor-critic's
(action, log_prob, value; act, evaluate, value, forward = evaluate), so PPO uses it unchanged.

LoRA (`policy.lora.rank` > 0) injects peft adapters into the backbone's named Linear layers after the pretrained
weights are in; then only the adapters and the heads (state token, queries, mean and value heads, log std) train.
`file_state` / `from_file_state` give policy.pt its layout: merged (the adapters folded in, the layout of the same
policy without LoRA) or adapters (only what trains).

Shard units (FSDP): every vision encoder layer and every decoder layer.

Over 400 lines: the policy is one module with its checks of the observation, its two action heads and its
LoRA and file layouts, which read best beside the forward pass they serve.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Protocol, cast

import gymnasium as gym
import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from spmd_rl.config.excerpts import clip
from spmd_rl.interfaces.policy import Policy, StepField
from spmd_rl.modules.actor_critic import actor_critic_outputs
from spmd_rl.modules.configs import VLAConfig
from spmd_rl.modules.distributions import (
    decision_sum,
    gaussian_entropy,
    gaussian_log_prob,
    tempered_log_std,
    tempered_logits,
)
from spmd_rl.modules.encoders import image_batch, image_layout
from spmd_rl.modules.pretrained import WeightSource, load_weights, read_json, read_model_config, weight_files
from spmd_rl.runtime.errors import UserError

ACTION_BINS = 256  # per action dimension, on the vocabulary's last ids (OpenVLA)
INIT_STD = 0.02
PROCESSOR_FILE = "preprocessor_config.json"  # where a model folder keeps its processor's image mean and std
SIGLIP_MEAN_STD = 0.5  # SigLIP's processor: pixels in [0, 1] to [-1, 1]

# Each preset's vision (SigLIP) and text (Gemma) config; the projector maps one to the other.
PRESETS = {
    "tiny": {  # ~5M parameters: tests
        "vision": dict(
            hidden_size=128,
            intermediate_size=512,
            num_hidden_layers=2,
            num_attention_heads=4,
            image_size=32,
            patch_size=8,
        ),
        "text": dict(
            hidden_size=256,
            intermediate_size=1024,
            num_hidden_layers=3,
            num_attention_heads=4,
            num_key_value_heads=1,
            head_dim=64,
            vocab_size=4096,
        ),
    },
    "small": {  # ~100M: the CPU benchmarks
        "vision": dict(
            hidden_size=384,
            intermediate_size=1536,
            num_hidden_layers=6,
            num_attention_heads=6,
            image_size=112,
            patch_size=14,
        ),
        "text": dict(
            hidden_size=768,
            intermediate_size=3072,
            num_hidden_layers=8,
            num_attention_heads=8,
            num_key_value_heads=1,
            head_dim=96,
            vocab_size=16384,
        ),
    },
    "base": {  # ~3B, PaliGemma-3B's shapes (SigLIP So400m/14 at 224, Gemma 2B): a GPU
        "vision": dict(
            hidden_size=1152,
            intermediate_size=4304,
            num_hidden_layers=27,
            num_attention_heads=16,
            image_size=224,
            patch_size=14,
        ),
        "text": dict(
            hidden_size=2048,
            intermediate_size=16384,
            num_hidden_layers=18,
            num_attention_heads=8,
            num_key_value_heads=1,
            head_dim=256,
            vocab_size=257216,
        ),
    },
}

# A PaliGemma checkpoint's tensor names -> the module's (transformers 5 nests them under `model.`; files written by
# save_pretrained and those on model hubs keep the original layout). First match wins.
FILE_PREFIXES = (
    ("language_model.lm_head.", "lm_head."),
    ("language_model.model.", "model.language_model."),
    ("language_model.", "model.language_model."),
    ("vision_tower.vision_model.", "model.vision_tower."),
    ("vision_tower.", "model.vision_tower."),
    ("multi_modal_projector.", "model.multi_modal_projector."),
)
UNBUILT = "model.vision_tower.head."  # SigLIP's attention-pooling head: the VLA reads every patch token instead


def paligemma_name(name: str) -> str | None:
    """The backbone's name for a checkpoint tensor; None for one the VLA does not build."""
    for old, new in FILE_PREFIXES:
        if name.startswith(old):
            name = new + name[len(old) :]
            break
    return None if name.startswith(UNBUILT) else name


def needs(package: str) -> None:
    """A clear line where the vla extra is not installed."""
    try:
        __import__(package)
    except ImportError:
        raise UserError(f"policy.class=vla needs the {package} package: pip install -e '.[vla]'") from None


def backbone_config(config: VLAConfig) -> tuple[Any, torch.dtype, tuple[list[float], list[float]]]:
    """(the PaliGemmaConfig, the dtype its weights files hold, the image (mean, std) per channel). A folder is
    checked before transformers is imported (seconds), so a bad one is refused at once."""
    mean = std = [SIGLIP_MEAN_STD] * 3
    if not config.pretrained:
        needs("transformers")
        from transformers import PaliGemmaConfig

        preset = PRESETS[config.preset]
        text = preset["text"]
        built = PaliGemmaConfig(vision_config=preset["vision"], text_config=text, projection_dim=text["hidden_size"])
        return built, torch.float32, (mean, std)
    folder = Path(config.pretrained).expanduser()
    raw = read_model_config(folder)
    if raw.get("model_type") != "paligemma":
        raise UserError(
            f"policy.pretrained={clip(config.pretrained)}: config.json's model_type is "
            f"{clip(repr(raw.get('model_type')))}; the vla policy reads PaliGemma folders (model_type 'paligemma')"
        )
    weight_files(folder)  # present, or the index's files present
    dtype_name = str(raw.get("dtype") or raw.get("torch_dtype") or "float32")
    file_dtype = getattr(torch, dtype_name, None)
    if not isinstance(file_dtype, torch.dtype):
        raise UserError(
            f"policy.pretrained: {folder / 'config.json'} declares dtype {clip(dtype_name)}, not a torch dtype"
        )
    if (folder / PROCESSOR_FILE).is_file():
        processor = read_json(folder / PROCESSOR_FILE, "policy.pretrained:")
        mean, std = processor.get("image_mean", mean), processor.get("image_std", std)
    needs("transformers")
    from transformers import PaliGemmaConfig

    try:
        built = PaliGemmaConfig.from_dict(raw)
    except Exception as exc:  # transformers' own validation of the values
        raise UserError(f"policy.pretrained: {folder / 'config.json'} is not a valid PaliGemma config: {exc}") from None
    return built, file_dtype, (list(mean), list(std))


def build_backbone(
    config: VLAConfig,
) -> tuple[nn.Module, tuple[list[float], list[float]], dict[str, WeightSource]]:
    """The PaliGemma model (its pretrained weights in when policy.pretrained is set), the image mean and std, and
    where each of its tensors is in the folder's files (empty without policy.pretrained)."""
    built, file_dtype, mean_std = backbone_config(config)
    from transformers import PaliGemmaForConditionalGeneration

    built.vision_config.vision_use_head = False
    if config.pretrained:
        # Every weight comes from the folder (a tensor it lacks is refused), so none is drawn at random first: that
        # took 5 of the 5.5 s to build the 91M small preset here. Buffers computed in the constructors (rotary
        # frequencies) are made as usual; the language head is tied to the embeddings by hand, as init would.
        from transformers.initialization import no_init_weights

        with no_init_weights():
            model = PaliGemmaForConditionalGeneration(built)
        model.tie_weights()
    else:
        model = PaliGemmaForConditionalGeneration(built)
    # transformers' own `to` is typed through functools.wraps, which mypy cannot bind to the instance.
    backbone = cast(nn.Module, model).to(torch.float32)
    sources = {}
    if config.pretrained:
        sources = load_weights(backbone, Path(config.pretrained).expanduser(), paligemma_name, file_dtype)
    return backbone, mean_std, sources


def add_lora(backbone: nn.Module, config: VLAConfig) -> None:
    """Inject peft LoRA adapters into the named Linear layers and freeze everything else of the backbone."""
    needs("peft")
    from peft import LoraConfig, inject_adapter_in_model

    lora = config.lora
    adapters = LoraConfig(
        r=lora.rank,
        lora_alpha=lora.alpha,  # type: ignore[arg-type]  # peft annotates it int; it scales by alpha / rank, a float
        lora_dropout=lora.dropout,
        target_modules=list(lora.target_modules),
    )
    try:
        inject_adapter_in_model(adapters, backbone)
    except ValueError as exc:  # peft: no module matched
        linears = sorted({name.rsplit(".", 1)[-1] for name, m in backbone.named_modules() if isinstance(m, nn.Linear)})
        raise UserError(
            f"policy.lora.target_modules={list(lora.target_modules)} match no layer of the backbone "
            f"({clip(str(exc).splitlines()[0] if str(exc) else type(exc).__name__)}); its Linear layers are named "
            f"{', '.join(linears)}"
        ) from None
    for name, parameter in backbone.named_parameters():
        parameter.requires_grad_("lora_" in name)


class LoraLayer(Protocol):
    """What file_state reads of a layer peft wrapped with an adapter."""

    def get_delta_weight(self, adapter: str) -> Tensor: ...


class VLAPolicy(Policy):
    """Images, instruction tokens, a state token and action queries through a PaliGemma backbone; action and value
    heads on the queries. `forward(obs, action)` is `evaluate` so DDP and FSDP can wrap it."""

    Config = VLAConfig
    # transformers' PaliGemmaForConditionalGeneration, read by its submodules' and configs' names (transformers
    # types its sub-configs as dict | PretrainedConfig | None and its towers as AutoModel's: nothing to check).
    backbone: Any
    observation_space: gym.spaces.Dict  # checked by _check_spaces

    def __init__(self, observation_space: gym.Space, action_space: gym.Space, config: VLAConfig):
        super().__init__(observation_space, action_space, config)
        self._check_spaces(observation_space, action_space, config)
        assert isinstance(observation_space, gym.spaces.Dict) and isinstance(action_space, gym.spaces.Box)  # checked
        self.backbone, (mean, std), sources = build_backbone(config)
        text, vision = self.backbone.config.text_config, self.backbone.config.vision_config
        width = text.hidden_size
        if len(mean) != vision.num_channels or len(std) != vision.num_channels:
            raise UserError(
                f"policy.pretrained: {PROCESSOR_FILE} gives {len(mean)} image_mean and {len(std)} image_std values "
                f"for a vision encoder of {vision.num_channels} channels"
            )
        if config.action_head == "bins" and text.vocab_size < ACTION_BINS:
            raise UserError(
                f"policy.action_head=bins takes the vocabulary's last {ACTION_BINS} ids, but the decoder has "
                f"{text.vocab_size}; use action_head=gaussian"
            )
        self._check_images(observation_space, config, vision.num_channels)
        self._check_instruction(observation_space, config, text.vocab_size)
        self.image_size = vision.image_size
        self.register_buffer("image_mean", torch.tensor(mean, dtype=torch.float32).view(1, -1, 1, 1), persistent=False)
        self.register_buffer("image_std", torch.tensor(std, dtype=torch.float32).view(1, -1, 1, 1), persistent=False)
        # env.action_chunk K > 1 makes the action space the chunk's, Box [K, A] (envs/chunks.py).
        shape = tuple(action_space.shape)
        self.chunk, self.dims = (shape[0] if len(shape) == 2 else 1), shape[-1]
        self.action_field = StepField(shape, torch.float32)
        queries = self.chunk * self.dims
        if config.state_key:
            state_space = cast(gym.spaces.Box, observation_space[config.state_key])  # a Box: assumed, not checked
            state_features = math.prod(state_space.shape)
            self.state_token = nn.Linear(state_features, width)
        self.action_queries = nn.Parameter(torch.empty(queries, width))
        nn.init.trunc_normal_(self.action_queries, std=INIT_STD)
        if config.action_head == "gaussian":
            self.mean_head = nn.Linear(width, 1)
            nn.init.orthogonal_(self.mean_head.weight, 0.01)  # near-zero first actions, as the actor-critic's
            nn.init.zeros_(self.mean_head.bias)
            self.log_std = nn.Parameter(torch.full((queries,), float(config.log_std_init)))
        else:  # the bins' bounds, per dimension of the chunk (finite: checked)
            low, high = (
                torch.as_tensor(b, dtype=torch.float32).reshape(-1) for b in (action_space.low, action_space.high)
            )
            self.register_buffer("action_low", low, persistent=False)
            self.register_buffer("action_high", high, persistent=False)
        self.value_head = nn.Linear(width, 1)
        nn.init.orthogonal_(self.value_head.weight, 1.0)
        nn.init.zeros_(self.value_head.bias)
        if config.lora.rank:
            add_lora(self.backbone, config)
        # the policy's names of the folder's tensors: a layer peft wrapped holds its weight as base_layer's
        wrapped = {name.removeprefix("backbone.") for name, _ in self._lora_layers()}
        self._file_sources = {
            "backbone." + (f"{layer}.base_layer.{kind}" if layer in wrapped else name): source
            for name, source in sources.items()
            for layer, _, kind in [name.rpartition(".")]
        }

    # -- checks -----------------------------------------------------------------------------------------------

    @staticmethod
    def _check_spaces(observation_space: gym.Space, action_space: gym.Space, config: VLAConfig) -> None:
        if not (isinstance(action_space, gym.spaces.Box) and len(action_space.shape) in (1, 2)):
            raise UserError(
                f"action space {action_space} is not supported by the vla policy (a 1-D Box, or a chunk of them with "
                f"env.action_chunk: its actions are continuous, or binned within the bounds); wrap the env or bring "
                f"your own policy.class"
            )
        if config.action_head == "bins" and not (
            np.isfinite(action_space.low).all() and np.isfinite(action_space.high).all()
        ):
            raise UserError(
                f"policy.action_head=bins spreads 256 bins between the action bounds, but {action_space} has "
                f"infinite ones; bound the actions (gymnasium's ClipAction / RescaleAction) or use action_head=gaussian"
            )
        if not isinstance(observation_space, gym.spaces.Dict):
            raise UserError(
                f"observation space {observation_space} is not supported by the vla policy: it reads a Dict of "
                f"camera images (policy.image_keys), a state (policy.state_key) and an instruction "
                f"(policy.instruction_key)"
            )
        if not config.image_keys:
            raise UserError("policy.image_keys is empty; name at least one camera image of the observation")
        named = [(f"policy.image_keys[{i}]", key) for i, key in enumerate(config.image_keys)]
        named += [
            (k, v)
            for k, v in (("policy.state_key", config.state_key), ("policy.instruction_key", config.instruction_key))
            if v
        ]
        for knob, key in named:
            if key not in observation_space.spaces:
                raise UserError(
                    f"{knob}={clip(key)} is not a key of the observation (its keys: "
                    f"{', '.join(observation_space.spaces)}); name one, or '' for none"
                )

    @staticmethod
    def _check_images(space: gym.spaces.Dict, config: VLAConfig, channels: int) -> None:
        for key in config.image_keys:
            image = space[key]
            if not (isinstance(image, gym.spaces.Box) and len(image.shape) in (2, 3)):
                raise UserError(
                    f"policy.image_keys: observation['{key}'] {image} is not an image (H x W x C or C x H x W)"
                )
            c = image_layout(image)[1][0]
            if c not in (1, channels):
                raise UserError(
                    f"policy.image_keys: observation['{key}'] has {c} channel(s); the vision encoder takes {channels}; "
                    f"give {channels} or 1 (repeated)"
                )

    @staticmethod
    def _check_instruction(space: gym.spaces.Dict, config: VLAConfig, vocab_size: int) -> None:
        if not config.instruction_key:
            return
        text = space[config.instruction_key]
        if not (isinstance(text, gym.spaces.Dict) and {"ids", "mask"} <= set(text.spaces)):
            raise UserError(
                f"policy.instruction_key: observation['{config.instruction_key}'] {text} is not token ids: give a "
                f"Dict with 'ids' and 'mask' (as text observations arrive tokenized)"
            )
        ids = cast(gym.spaces.Box, text["ids"])  # a Box, as TokenizedText's: assumed, not checked
        highest = int(np.max(ids.high))
        if highest >= vocab_size:
            raise UserError(
                f"policy.instruction_key: observation['{config.instruction_key}']['ids'] goes up to {highest}, but "
                f"the decoder's vocabulary has {vocab_size} ids; tokenize with the model's own tokenizer"
            )

    # -- the Policy contract --------------------------------------------------------------------------------

    def shard_units(self) -> list[nn.Module]:
        """The modules FSDP shards one by one (the rest goes with the root): vision and decoder layers."""
        inner = self.backbone.model
        return [*inner.vision_tower.encoder.layers, *inner.language_model.layers]

    def outputs(self) -> dict[str, StepField]:
        return actor_critic_outputs(self.action_field)

    def _pixels(self, image: Tensor, space: gym.spaces.Box) -> Tensor:
        """An image batch as the vision encoder expects it: [B, C, size, size], normalized."""
        x = image_batch(image, *image_layout(space))
        if x.shape[1] != self.image_mean.shape[1]:  # one channel, repeated (checked at construction)
            x = x.expand(-1, self.image_mean.shape[1], -1, -1)
        if tuple(x.shape[-2:]) != (self.image_size, self.image_size):
            x = F.interpolate(x, size=(self.image_size, self.image_size), mode="bilinear", antialias=True)
        return (x - self.image_mean) / self.image_std

    def query_states(self, obs) -> Tensor:
        """The action queries' final hidden states [B, K * A, width]."""
        config, inner = self.config, self.backbone.model
        tokens: list[tuple[Tensor, Tensor | None]] = []  # (embeddings [B, n, width], mask [B, n] or None: all kept)
        for key in config.image_keys:
            space = cast(gym.spaces.Box, self.observation_space[key])  # an image Box (_check_images)
            patches = inner.vision_tower(pixel_values=self._pixels(obs[key], space))
            tokens.append((inner.multi_modal_projector(patches.last_hidden_state), None))
        batch = tokens[0][0].shape[0]
        if config.instruction_key:
            text = obs[config.instruction_key]
            tokens.append((inner.language_model.embed_tokens(text["ids"].long()), text["mask"].long()))
        if config.state_key:
            state = obs[config.state_key].reshape(batch, -1).to(torch.float32)
            tokens.append((self.state_token(state).unsqueeze(1), None))
        tokens.append((self.action_queries.expand(batch, -1, -1), None))
        dtype = tokens[-1][0].dtype  # under autocast the linear maps' outputs are bf16, the embeddings not
        embeds = torch.cat([part.to(dtype) for part, _ in tokens], dim=1)
        mask = torch.cat(
            [
                torch.ones(part.shape[:2], dtype=torch.long, device=part.device) if m is None else m
                for part, m in tokens
            ],
            dim=1,
        )
        hidden = inner.language_model(inputs_embeds=embeds, attention_mask=mask).last_hidden_state
        return hidden[:, -self.action_queries.shape[0] :]

    def heads(self, obs) -> tuple[Tensor, Tensor]:
        """(per action dimension: the Gaussian's mean [B, K * A] or the bins' logits [B, K * A, 256]; V [B]),
        float32 (under bf16 autocast too)."""
        hidden = self.query_states(obs)
        value = self.value_head(hidden[:, -1]).float().squeeze(-1)
        if self.config.action_head == "gaussian":
            return self.mean_head(hidden).float().squeeze(-1), value
        bins = self.backbone.lm_head.weight[-ACTION_BINS:]
        return F.linear(hidden, bins).float(), value

    def value(self, obs) -> Tensor:
        """V(obs), shape [B]."""
        return self.heads(obs)[1]

    def _bin_of(self, action: Tensor) -> Tensor:
        scaled = (action - self.action_low) / (self.action_high - self.action_low) * ACTION_BINS
        return scaled.floor().clamp(0, ACTION_BINS - 1).long()

    def _action_of(self, bins: Tensor) -> Tensor:
        width = (self.action_high - self.action_low) / ACTION_BINS
        return self.action_low + (bins.to(torch.float32) + 0.5) * width  # each bin's centre

    def act(self, obs, deterministic: bool = False) -> dict[str, Tensor]:
        """Sample an action chunk (the mode when deterministic) with its log-prob and the value; Gaussian actions
        are unclipped (the env side clips). Called under torch.no_grad()."""
        out, value = self.heads(obs)
        temperature = self.config.temperature  # rollouts sample at it; log-probs are its (modules/distributions.py)
        if self.config.action_head == "gaussian":
            log_std = tempered_log_std(self.log_std, temperature)
            action = out if deterministic else out + log_std.exp() * torch.randn_like(out)
            log_prob = gaussian_log_prob(out, action, log_std)
        else:
            log_probs = torch.log_softmax(tempered_logits(out, temperature), dim=-1)
            if deterministic:
                bins = log_probs.argmax(-1)
            else:  # Gumbel-max, as the actor-critic samples
                bins = (log_probs - torch.empty_like(log_probs).exponential_().log()).argmax(-1)
            log_prob = log_probs.gather(-1, bins.unsqueeze(-1)).squeeze(-1).sum(-1)
            action = self._action_of(bins)
        return {"action": action.reshape(-1, *self.action_field.shape), "log_prob": log_prob, "value": value}

    def evaluate(self, obs, action: Tensor, chunk_valid: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor]:
        """(log_prob, entropy, value) of given action chunks, each [B], with gradients; with chunk_valid [B, K] the
        log_prob of the chunk's valid steps only (modules/distributions.py; bc on demonstrations)."""
        out, value = self.heads(obs)
        action = action.reshape(action.shape[0], -1)
        temperature = self.config.temperature
        if self.config.action_head == "gaussian":
            log_std = tempered_log_std(self.log_std, temperature)
            log_prob = gaussian_log_prob(out, action, log_std, chunk_valid)
            entropy = gaussian_entropy(log_std, out.shape[0])
        else:
            log_probs = torch.log_softmax(tempered_logits(out, temperature), dim=-1)
            log_prob = decision_sum(log_probs.gather(-1, self._bin_of(action).unsqueeze(-1)).squeeze(-1), chunk_valid)
            entropy = -(log_probs.exp() * log_probs).sum(-1).sum(-1)
        return log_prob, entropy, value

    def forward(self, obs, action: Tensor, chunk_valid: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor]:
        # DDP and FSDP hook forward(): the trainer calls model(obs, action) to get evaluate() with synced grads.
        return self.evaluate(obs, action, chunk_valid)

    # -- policy.pt with LoRA ---------------------------------------------------------------------------------

    def _lora_layers(self) -> list[tuple[str, nn.Module]]:
        """(name, layer) of every Linear peft wrapped with an adapter."""
        return [(name, m) for name, m in self.named_modules() if hasattr(m, "base_layer") and hasattr(m, "lora_A")]

    def _trainable(self) -> set[str]:
        return {name for name, parameter in self.named_parameters() if parameter.requires_grad}

    def file_sources(self) -> dict[str, WeightSource]:
        return self._file_sources

    def file_state(self) -> dict[str, Tensor]:
        """policy.pt: with LoRA and policy.lora.save=merged, each adapter folded into its layer's weight (the keys
        of the same policy without LoRA); with save=adapters, only the trainable tensors."""
        state = self.state_dict()
        if not self.config.lora.rank:
            return state
        if self.config.lora.save == "adapters":
            trainable = self._trainable()
            return {key: value for key, value in state.items() if key in trainable}
        merged = {key: value for key, value in state.items() if ".lora_" not in key}
        with torch.no_grad():
            for name, layer in self._lora_layers():
                delta = cast(LoraLayer, layer).get_delta_weight("default")
                merged[f"{name}.weight"] = merged.pop(f"{name}.base_layer.weight") + delta
                if f"{name}.base_layer.bias" in merged:
                    merged[f"{name}.bias"] = merged.pop(f"{name}.base_layer.bias")
        return merged

    def from_file_state(self, state: dict[str, Tensor]) -> dict[str, Tensor]:
        """A policy file in the state_dict layout: a checkpoint's as it is; a merged policy.pt with each merged
        weight as its layer's base and a zero adapter (the same function); an adapters-only one with the frozen
        rest as this policy was built (from policy.pretrained). What is missing stays missing (the loader names it)."""
        if not self.config.lora.rank or any(".base_layer." in key for key in state):
            return state
        own = self.state_dict()
        layers = self._lora_layers()
        if not any(f"{name}.weight" in state for name, _ in layers):  # adapters only
            trainable = self._trainable()
            return {key: value for key, value in own.items() if key not in trainable} | state
        full = dict(state)
        for name, _ in layers:
            for kind in ("weight", "bias"):
                if f"{name}.{kind}" in full:
                    full[f"{name}.base_layer.{kind}"] = full.pop(f"{name}.{kind}")
            for key in own:
                if key.startswith(f"{name}.lora_A."):
                    full[key] = own[key]
                elif key.startswith(f"{name}.lora_B."):
                    full[key] = torch.zeros_like(own[key])
        return full
