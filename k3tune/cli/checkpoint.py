"""`k3tune checkpoint check`: will a checkpoint's MoE layers load into the block executor (names, shapes, formats)?"""

from __future__ import annotations

from typing import Annotated

import typer
from rich.markup import escape

from k3tune.cli.common import ConfigOption, JsonOption, console, print_json
from k3tune.errors import ConfigError

app = typer.Typer(no_args_is_help=True, help="Check model checkpoints against what the MoE block executor loads.")


def _layers(text: str | None, all_moe: list[int]) -> list[int]:
    """'5', '1-92', '1,4,8-10' -> layer numbers (each an MoE layer of the config); None: every MoE layer."""
    if not text:
        return all_moe
    out = []
    try:
        for part in text.split(","):
            lo, _, hi = part.partition("-")
            if int(hi or lo) < int(lo):  # an empty range checked nothing and said OK
                raise ConfigError(f"--layers {text!r}: the range {part} runs backwards (write {hi}-{lo})")
            if all_moe and int(hi or lo) > max(all_moe):  # before the range is made: 1-1000000000 was a MemoryError
                raise ConfigError(f"--layers {text!r}: the config's last MoE layer is {max(all_moe)}")
            out += range(int(lo), int(hi or lo) + 1)
    except ValueError:
        raise ConfigError(f"--layers {text!r}: expected numbers and ranges, e.g. 1-92 or 3,5") from None
    if bad := sorted(set(out) - set(all_moe)):
        raise ConfigError(f"--layers: {bad[:5]} {'are' if len(bad) > 1 else 'is'} not MoE layers of the config")
    return list(dict.fromkeys(out))  # a layer named twice is checked (and counted) once


@app.command("check")
def check(
    path: Annotated[str, typer.Argument(help="A safetensors file, or a folder of shards (with or without "
                                             "model.safetensors.index.json).")],
    tp: Annotated[list[int], typer.Option("--tp", help="TP sizes the layers must shard to (repeatable).")] = [8, 16],
    layers: Annotated[str | None, typer.Option(help="Layers to check, e.g. 1-92 or 3,5 (default: every MoE layer).")] = None,
    config: ConfigOption = None,
    json: JsonOption = False,
) -> None:
    """Check, from the tensor headers only (no weights are read), that every MoE layer has each tensor the block
    loads, with the shape the config implies, experts in one format, and widths that shard to each --tp.
    Exit status 1 when anything is wrong.

    Example: k3tune checkpoint check /models/kimi-k3 --tp 16 --layers 1-4
    """
    from k3tune.plan.model import check_moe_fields, read_raw
    from k3tune.runtime.checkpoint import check_checkpoint, moe_layers, open_source
    from k3tune.runtime.moe import BlockShape

    if bad := [t for t in tp if t < 1]:  # tp 0 was a ZeroDivisionError traceback; a negative one "divided"
        raise ConfigError(f"--tp must be at least 1, not {bad[0]}")
    raw, cfg_path = read_raw(config)
    check_moe_fields(raw, str(cfg_path))  # typed as plan checks them (a string width made odd shape problems)
    shape = BlockShape.from_config(cfg_path)
    which = _layers(layers, moe_layers(raw))
    src = open_source(path)
    problems, formats = check_checkpoint(src, shape, which, tps=tp)
    if json:
        print_json({"checkpoint": path, "config": str(cfg_path), "layers": len(which), "tp": tp,
                    "expert_formats": formats, "problems": problems})
    else:
        for line in problems[:20]:
            console.print(f"[red]problem:[/] {escape(line)}")
        if len(problems) > 20:
            console.print(f"... and {len(problems) - 20} more (--json lists them all)")
        verdict = "[green]OK[/]" if not problems else f"[red]{len(problems)} problem(s)[/]"
        console.print(f"{escape(path)}: {len(which)} MoE layer(s), experts {'/'.join(formats) or '-'}, tp "
                      f"{','.join(map(str, tp))}: {verdict}")
    if problems:
        raise typer.Exit(1)

