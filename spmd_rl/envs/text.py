"""Text observations as token ids, on the env rank: a gymnasium `Text` space (alone or inside a Dict) becomes a
`TokenizedText` space of fixed length `env.max_text_tokens`, {"ids": the token ids, "mask": 1 where a token is},
so strings never cross the wire and every layout stays fixed.

`env.tokenizer` names how a string becomes ids: `bytes` (its UTF-8 bytes, a vocabulary of 256, no files), or a
local `tokenizer.json` or a folder holding one (the `tokenizers` library; a folder without one goes to transformers'
AutoTokenizer), never fetched from a hub. Ids travel in the smallest integer dtype that holds the vocabulary.

TokenizeText wraps a backend's vector env (envs/backend.py finish_vector_env): each env's string is tokenized when
it changes (an instruction once per episode), and one longer than env.max_text_tokens stops the run with a
UserError naming the length it needs.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path
from typing import Any, cast

import gymnasium as gym
import numpy as np

from spmd_rl.config.excerpts import clip
from spmd_rl.config.sections import EnvSection
from spmd_rl.runtime.errors import UserError

BYTES = "bytes"
TOKENIZER_FILE = "tokenizer.json"


class TokenizedText(gym.spaces.Dict):
    """A Text space after tokenization: {"ids": Box [max_tokens] of the id dtype, "mask": Box [max_tokens] uint8}.
    A Dict, so every layout (channels, segments, HDF5 files) carries it as nested keys; its own type, so the
    policies' encoders know to embed the ids (`vocab_size` of them) rather than read them as numbers."""

    def __init__(self, vocab_size: int, max_tokens: int, seed=None):
        self.vocab_size = int(vocab_size)
        super().__init__(
            {
                "ids": gym.spaces.Box(0, self.vocab_size - 1, (max_tokens,), dtype=token_dtype(self.vocab_size)),
                "mask": gym.spaces.Box(0, 1, (max_tokens,), dtype=np.uint8),
            },
            seed=seed,
        )

    def __repr__(self) -> str:
        tokens = cast(gym.spaces.Box, self["ids"]).shape[0]  # the Box made in __init__
        return f"TokenizedText(vocab {self.vocab_size}, {tokens} tokens)"

    def __eq__(self, other) -> bool:
        return isinstance(other, TokenizedText) and self.vocab_size == other.vocab_size and super().__eq__(other)


def token_dtype(vocab_size: int) -> np.dtype:
    """The smallest integer dtype that holds ids 0 .. vocab_size - 1 (uint8 for bytes)."""
    for dtype in (np.uint8, np.int16, np.int32):
        if vocab_size - 1 <= np.iinfo(dtype).max:
            return np.dtype(dtype)
    return np.dtype(np.int64)


def has_text(space: gym.Space) -> bool:
    if isinstance(space, gym.spaces.Text):
        return True
    return isinstance(space, gym.spaces.Dict) and any(has_text(sub) for sub in space.spaces.values())


class ByteTokenizer:
    """A string's UTF-8 bytes as ids (0-255): no files, no vocabulary to ship."""

    vocab_size = 256

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))


class FileTokenizer:
    """A tokenizer saved locally: a tokenizer.json (the `tokenizers` library), or a transformers tokenizer folder."""

    tokenizer: Any  # a tokenizers.Tokenizer or a transformers tokenizer: two libraries' classes, no common base
    vocab_size: int
    _encode: Callable[[str], list[int]]

    def __init__(self, path: Path):
        file = path / TOKENIZER_FILE if path.is_dir() else path
        if file.is_file():
            try:
                from tokenizers import Tokenizer
            except ImportError:
                raise UserError(
                    f"env.tokenizer={clip(str(path))} needs the tokenizers library: pip install -e '.[text]'"
                ) from None
            try:
                self.tokenizer = Tokenizer.from_file(str(file))
            except Exception as exc:  # the library's parse error: not a tokenizer file
                raise UserError(f"env.tokenizer: {clip(str(file))} is not a tokenizer.json: {clip(str(exc))}") from None
            self.vocab_size = self.tokenizer.get_vocab_size(with_added_tokens=True)
            self._encode = lambda text: self.tokenizer.encode(text).ids
            return
        try:
            from transformers import AutoTokenizer
        except ImportError:
            raise UserError(
                f"env.tokenizer: the folder {clip(str(path))} holds no {TOKENIZER_FILE}; save the tokenizer there "
                f"(tokenizer.save) or install transformers to load the folder with AutoTokenizer"
            ) from None
        try:
            self.tokenizer = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
        except Exception as exc:
            raise UserError(f"env.tokenizer: {clip(str(path))} cannot be loaded: {clip(str(exc))}") from None
        self.vocab_size = len(self.tokenizer)
        self._encode = lambda text: self.tokenizer.encode(text)

    def encode(self, text: str) -> list[int]:
        return list(self._encode(text))


def make_tokenizer(cfg: EnvSection):
    """The tokenizer env.tokenizer names; a path that does not exist is a UserError saying what to give."""
    if cfg.tokenizer == BYTES:
        return ByteTokenizer()
    path = Path(cfg.tokenizer).expanduser()
    if not path.exists():
        raise UserError(
            f"env.tokenizer={clip(cfg.tokenizer)}: no such file or folder; give '{BYTES}', a {TOKENIZER_FILE} or "
            f"a local tokenizer folder"
        )
    return FileTokenizer(path)


def tokenized_space(space: gym.Space, cfg: EnvSection, vocab_size: int) -> gym.Space:
    """The space with every Text replaced by its TokenizedText of env.max_text_tokens."""
    if isinstance(space, gym.spaces.Text):
        return TokenizedText(vocab_size, cfg.max_text_tokens)
    if isinstance(space, gym.spaces.Dict):
        return gym.spaces.Dict({key: tokenized_space(sub, cfg, vocab_size) for key, sub in space.spaces.items()})
    return space


def tokenized_spec(spec, cfg: EnvSection):
    """An EnvSpec whose text observations are token ids (the spec unchanged without text)."""
    if not has_text(spec.observation_space):
        return spec
    vocab_size = make_tokenizer(cfg).vocab_size
    return dataclasses.replace(spec, observation_space=tokenized_space(spec.observation_space, cfg, vocab_size))


class TokenizeText(gym.vector.VectorObservationWrapper):
    """A vector env whose Text observations come out as {"ids", "mask"} arrays [num_envs, env.max_text_tokens].
    Each env's last string and its tokens are kept: an instruction is tokenized once per episode, not every step."""

    def __init__(self, env: gym.vector.VectorEnv, cfg: EnvSection):
        super().__init__(env)
        self.tokenizer = make_tokenizer(cfg)
        self.max_tokens = cfg.max_text_tokens
        self.env_id = cfg.id
        self.single_observation_space = tokenized_space(env.single_observation_space, cfg, self.tokenizer.vocab_size)
        self.observation_space = gym.vector.utils.batch_space(self.single_observation_space, env.num_envs)
        self._last: dict[tuple, list] = {}  # text path -> each env's (string, ids row, mask row)

    def observations(self, observations):
        return self._tokenize(self.env.single_observation_space, observations, ())

    def _tokenize(self, space: gym.Space, values, path: tuple):
        if isinstance(space, gym.spaces.Dict):
            return {key: self._tokenize(sub, values[key], (*path, key)) for key, sub in space.spaces.items()}
        if not isinstance(space, gym.spaces.Text):
            return values
        dtype = token_dtype(self.tokenizer.vocab_size)
        last = self._last.setdefault(path, [None] * self.num_envs)
        ids = np.zeros((self.num_envs, self.max_tokens), dtype=dtype)
        mask = np.zeros((self.num_envs, self.max_tokens), dtype=np.uint8)
        for i, text in enumerate(values):
            if last[i] is None or last[i][0] != text:
                last[i] = (text, *self._encode(text, path))
            ids[i], mask[i] = last[i][1], last[i][2]
        return {"ids": ids, "mask": mask}

    def _encode(self, text: str, path: tuple) -> tuple[np.ndarray, np.ndarray]:
        tokens = self.tokenizer.encode(text)
        if len(tokens) > self.max_tokens:
            where = "".join(f"['{key}']" for key in path)
            raise UserError(
                f"env '{clip(self.env_id)}': the text observation{where} {clip(repr(text), 80)} is {len(tokens)} "
                f"tokens, longer than env.max_text_tokens={self.max_tokens}; set env.max_text_tokens={len(tokens)} "
                f"or more"
            )
        ids = np.zeros(self.max_tokens, dtype=token_dtype(self.tokenizer.vocab_size))
        mask = np.zeros(self.max_tokens, dtype=np.uint8)
        ids[: len(tokens)] = tokens
        mask[: len(tokens)] = 1
        return ids, mask
