"""What the VLA tests make for themselves: a tiny PaliGemma model folder (sharded safetensors, a WordLevel tokenizer
beside it, as save_pretrained writes them; no hub) and an instructed reaching env with camera image, state and
instruction token ids.

    env.id=tests.harness.vla_fixtures:InstructedReach-v0      (the repository root on PYTHONPATH or as the cwd)

The env's instruction arrives as token ids and a mask ({"ids", "mask"} under "instruction"), the layout text
observations travel in; the ids are the fixture tokenizer's, for the words of WORDS.
"""

from __future__ import annotations

from pathlib import Path

import gymnasium as gym
import numpy as np

WORDS = ["[PAD]", "[UNK]", "reach", "the", "red", "blue", "target", "left", "right"]
VOCAB_SIZE = 300  # the words, then unused ids; the last 256 are the action bins
MAX_TOKENS = 6
TARGETS = {"red": np.array([0.5, -0.5], dtype=np.float32), "blue": np.array([-0.5, 0.5], dtype=np.float32)}
EPISODE_STEPS = 8


def tiny_paligemma_config(vocab_size: int = VOCAB_SIZE, image_size: int = 16):
    """A PaliGemma of ~60k parameters: SigLIP 2 layers of width 32 at 16 x 16 pixels, Gemma 2 layers of width 32."""
    from transformers import GemmaConfig, PaliGemmaConfig, SiglipVisionConfig

    vision = SiglipVisionConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        image_size=image_size,
        patch_size=8,
    )
    text = GemmaConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
        vocab_size=vocab_size,
    )
    return PaliGemmaConfig(vision_config=vision.to_dict(), text_config=text.to_dict(), projection_dim=32)


def make_model_folder(folder: Path, seed: int = 0, max_shard_size: str = "20KB") -> Path:
    """A tiny PaliGemma saved with save_pretrained in several shards (model.safetensors.index.json), with a
    WordLevel tokenizer of WORDS; returns the folder."""
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PaliGemmaForConditionalGeneration, PreTrainedTokenizerFast

    torch.manual_seed(seed)
    model = PaliGemmaForConditionalGeneration(tiny_paligemma_config())
    model.save_pretrained(folder, max_shard_size=max_shard_size)
    tokenizer = Tokenizer(models.WordLevel({word: i for i, word in enumerate(WORDS)}, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tokenizer, pad_token="[PAD]", unk_token="[UNK]").save_pretrained(folder)
    return Path(folder)


def instruction_ids(text: str) -> tuple[np.ndarray, np.ndarray]:
    """The instruction's ids (the fixture tokenizer's, padded to MAX_TOKENS) and mask."""
    tokens = [WORDS.index(word) for word in text.split()]
    ids = np.zeros(MAX_TOKENS, dtype=np.int64)
    mask = np.zeros(MAX_TOKENS, dtype=np.uint8)
    ids[: len(tokens)], mask[: len(tokens)] = tokens, 1
    return ids, mask


class InstructedReach(gym.Env):
    """Move a point to the target the instruction names ("reach the red target" / "reach the blue target"): the
    camera image shows the point, the state is its position, the action its step in [-1, 1]^2 (scaled by 0.2);
    reward is minus the distance after the step, info["success"] when it is within 0.2."""

    def __init__(self, image_size: int = 20):
        self.size = image_size
        self.observation_space = gym.spaces.Dict(
            {
                "image": gym.spaces.Box(0, 255, (image_size, image_size, 3), dtype=np.uint8),
                "state": gym.spaces.Box(-1.0, 1.0, (2,), dtype=np.float32),
                "instruction": gym.spaces.Dict(
                    {
                        "ids": gym.spaces.Box(0, len(WORDS) - 1, (MAX_TOKENS,), dtype=np.int64),
                        "mask": gym.spaces.Box(0, 1, (MAX_TOKENS,), dtype=np.uint8),
                    }
                ),
            }
        )
        self.action_space = gym.spaces.Box(-1.0, 1.0, (2,), dtype=np.float32)
        self.position = np.zeros(2, dtype=np.float32)
        self.target = "red"
        self.steps = 0

    def _observation(self) -> dict:
        image = np.zeros((self.size, self.size, 3), dtype=np.uint8)
        row, column = ((self.position + 1) / 2 * (self.size - 1)).round().astype(int)
        image[row, column] = 255
        ids, mask = instruction_ids(f"reach the {self.target} target")
        return {"image": image, "state": self.position.copy(), "instruction": {"ids": ids, "mask": mask}}

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self.target = str(self.np_random.choice(sorted(TARGETS)))
        self.position = np.zeros(2, dtype=np.float32)
        self.steps = 0
        return self._observation(), {}

    def step(self, action):
        self.position = np.clip(self.position + 0.2 * np.clip(action, -1, 1), -1, 1).astype(np.float32)
        self.steps += 1
        distance = float(np.linalg.norm(self.position - TARGETS[self.target]))
        return self._observation(), -distance, False, self.steps >= EPISODE_STEPS, {"success": distance < 0.2}


if "InstructedReach-v0" not in gym.registry:  # imported as harness.vla_fixtures and as tests.harness.vla_fixtures
    gym.register(id="InstructedReach-v0", entry_point=InstructedReach)
