"""Writes the "pretrained" encoder that frozen_policy.py loads: `python make_encoder.py [--out encoder.safetensors]`.

The pretraining stands in for a backbone trained elsewhere: PixelEncoder learns, as the encoder half of an
autoencoder, to reconstruct Catch frames from random play (ball and paddle anywhere), so its features hold where
the ball and the paddle are without ever seeing a reward. A few seconds on a CPU. The encoder's weights (not the
decoder's) are saved with safetensors, the format pretrained models ship in; the tensors' names are the encoder's
own (`net.0.weight`, ...), as `FrozenEncoderPolicy` loads them.
"""

from __future__ import annotations

import argparse

import catch_env  # noqa: F401  (registers Catch-v0)
import gymnasium as gym
import numpy as np
import torch
from frozen_policy import FEATURES, PixelEncoder
from safetensors.torch import save_file
from torch import nn


def random_play_frames(count: int, seed: int, rows: int, columns: int) -> torch.Tensor:
    env = gym.make("Catch-v0", rows=rows, columns=columns)
    rng = np.random.default_rng(seed)
    frames = []
    obs, _ = env.reset(seed=seed)
    while len(frames) < count:
        frames.append(obs)
        obs, _, terminated, truncated, _ = env.step(int(rng.integers(env.action_space.n)))
        if terminated or truncated:
            obs, _ = env.reset()
    return torch.as_tensor(np.stack(frames))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="encoder.safetensors")
    parser.add_argument("--rows", type=int, default=10)
    parser.add_argument("--columns", type=int, default=5)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    torch.manual_seed(args.seed)
    torch.set_num_threads(1)  # small convolutions: one thread is as fast, and shares a machine better
    frames = random_play_frames(2048, args.seed, args.rows, args.columns)
    encoder = PixelEncoder(args.rows, args.columns, 1)
    decoder = nn.Linear(FEATURES, args.rows * args.columns)  # logits of each pixel being lit
    optimizer = torch.optim.Adam([*encoder.parameters(), *decoder.parameters()], lr=3e-3)
    targets = (frames.reshape(len(frames), -1) > 0).float()
    for _ in range(args.steps):
        index = torch.randint(len(frames), (128,))
        loss = nn.functional.binary_cross_entropy_with_logits(decoder(encoder(frames[index])), targets[index])
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    with torch.no_grad():
        lit = decoder(encoder(frames)) > 0
        exact = (lit == targets.bool()).all(-1).float().mean().item()
    save_file({name: t.contiguous() for name, t in encoder.state_dict().items()}, args.out)
    print(f"wrote {args.out}: reconstruction loss {loss.item():.4f}, {exact:.1%} of frames reconstructed exactly")


if __name__ == "__main__":
    main()
