"""Regenerates configs/routing/synthetic.jsonl: 512 decode tokens of K3-shaped routing (896 experts, top-16)
with skewed popularity and temporal locality (consecutive tokens share some experts). Synthetic: a stand-in
until a recorded K3 trace ships. Run: python configs/routing/make_synthetic_trace.py"""

import json
import random
from pathlib import Path

EXPERTS, TOP_K, TOKENS, SEED = 896, 16, 512, 2026

if __name__ == "__main__":
    rng = random.Random(SEED)
    popularity = [1 / (i + 1) ** 0.8 for i in range(EXPERTS)]
    perm = list(range(EXPERTS))
    rng.shuffle(perm)
    prev: list[int] = []
    lines = [json.dumps({"format": "k3tune-routing-trace", "version": 1, "experts": EXPERTS, "top_k": TOP_K})]
    for _ in range(TOKENS):
        chosen = set(rng.sample(prev, k=min(len(prev), 4)))  # locality: a few experts carry over
        while len(chosen) < TOP_K:
            chosen.add(perm[rng.choices(range(EXPERTS), weights=popularity)[0]])
        prev = sorted(chosen)
        lines.append(json.dumps({"experts": prev}))
    Path(__file__).with_name("synthetic.jsonl").write_text("\n".join(lines) + "\n")
