"""SASS of the tensor-core expert kernels, and the instruction mix of their K loop.

CuTe DSL compiles on the CPU, and cuobjdump / nvdisasm come as pip wheels (``pip install -e ".[sass]"``; the GPU
machine has them on its PATH), so all of it runs on the CPU:

    python bench/expert_sass.py compile DIR mxfp4 w13=1,1,4,1,1,1,1,1,0,2 w2=1,4,1,1,2,1,4,1,0,0
    python bench/expert_sass.py dump DIR                  (cuobjdump -sass of each DIR/*.cubin)
    python bench/expert_sass.py regs DIR                  (registers, stack and local memory (spills) of each)
    python bench/expert_sass.py mix DIR/*.sass            (opcodes of each kernel's K loop)

``compile`` takes TcExpertConfig's fields in order (``NAME=...``, NAME starting w13 or w2, K3's K: 3584 / 3072 / tp
with --tp) and writes NAME.cubin. ``mix`` counts the opcodes of the innermost loop that holds HMMAs (the K loop),
with the pipe each one issues on (ALU, FMA, other), per 32-bit word of weights the loop decodes when given --words.
"""
import argparse
import collections
import importlib.util
import os
import pathlib
import re
import shutil
import subprocess
import tempfile

ALU = ("LOP3", "SHF", "ISETP", "SEL", "IMNMX", "VIMNMX", "PRMT", "LEA", "IADD3", "FSEL", "PLOP3", "FLO", "POPC")
FMA = ("IMAD", "HFMA2", "HMUL2", "HADD2", "FFMA", "FMUL", "FADD", "VIADD")


def device_cubins(fn, name: str) -> list:
    """The device ELFs (cubins) inside a compiled CuTe DSL function's object (the first ELF is the host's)."""
    data = fn.dump_to_object(name)
    return [data[i:] for i in [i for i in range(len(data)) if data.startswith(b"\x7fELF", i)][1:]]


def cuobjdump(*args) -> str:
    """cuobjdump's output: the one of the ``sass`` extra's wheels where installed (with its nvdisasm, which -sass
    runs, on the PATH), else the one on the PATH (the GPU machine's)."""
    env = dict(os.environ)
    try:
        spec = importlib.util.find_spec("nvidia.cu13")  # the wheels' namespace package
    except ModuleNotFoundError:
        spec = None
    for d in (spec.submodule_search_locations or []) if spec else []:
        if (pathlib.Path(d) / "bin" / "cuobjdump").exists():
            env["PATH"] = f"{pathlib.Path(d) / 'bin'}{os.pathsep}{env.get('PATH', '')}"
            break
    exe = shutil.which("cuobjdump", path=env.get("PATH"))
    if exe is None:
        raise SystemExit('error: no cuobjdump: pip install -e ".[sass]" (or run where the CUDA toolkit is)')
    return subprocess.run([exe, *args], capture_output=True, text=True, check=True, env=env).stdout


def disassemble(cubin) -> str:
    """cuobjdump -sass of a cubin file."""
    return cuobjdump("-sass", str(cubin))


def resources(cubin) -> dict:
    """Per kernel in a cubin: {"REG": registers a thread, "STACK": bytes, "LOCAL": bytes of local memory (spills),
    "SHARED": static shared bytes}, from cuobjdump -res-usage."""
    out, name = {}, None
    for line in cuobjdump("-res-usage", str(cubin)).splitlines():
        if line.strip().startswith("Function "):
            name = line.strip()[len("Function "):].rstrip(":")
        elif name and "REG:" in line:
            out[name] = {k: int(v) for k, v in re.findall(r"(REG|STACK|SHARED|LOCAL):(\d+)", line)}
    return out


def compile_cubins(out: pathlib.Path, fmt: str, specs: list, tp: int) -> None:
    # a kernel loaded from the disk cache holds no module to dump: compile afresh, through an empty cache (the cache
    # path also loads the runtime library that dumping needs on a CPU-only machine; K3TUNE_KERNEL_CACHE=off does not)
    cache = tempfile.mkdtemp(prefix="k3tune-sass-")
    os.environ["K3TUNE_KERNEL_CACHE"] = cache
    try:
        _compile_into(out, fmt, specs, tp)
    finally:
        shutil.rmtree(cache, ignore_errors=True)


def _compile_into(out: pathlib.Path, fmt: str, specs: list, tp: int) -> None:
    from k3tune.kernels import moe_experts_tc as tc

    out.mkdir(parents=True, exist_ok=True)
    for spec in specs:
        name, knobs = spec.split("=")
        kind = "w13" if name.startswith("w13") else "w2"
        cfg = tc.TcExpertConfig(*(int(a) for a in knobs.split(",")))
        k = 3584 if kind == "w13" else 3072 // tp
        fn = tc.compiled(kind, tc.kernel_knobs(kind, cfg, fmt, k, 4.0, 25.0), fmt, tc.current_arch())
        (out / f"{name}.cubin").write_bytes(device_cubins(fn, name)[0])
        print(f"{out / name}.cubin: {kind} {cfg}")


def dump(directory: pathlib.Path) -> None:
    for cubin in sorted(directory.glob("*.cubin")):
        sass = disassemble(cubin)
        cubin.with_suffix(".sass").write_text(sass)
        print(f"{cubin.with_suffix('.sass')}: {len(sass.splitlines())} lines")


def regs(directory: pathlib.Path) -> None:
    for cubin in sorted(directory.glob("*.cubin")):
        for name, r in resources(cubin).items():
            print(f"{cubin.name}: REG {r['REG']} STACK {r['STACK']} LOCAL {r['LOCAL']} SHARED {r['SHARED']}",
                  name[:60])


def loop_mix(text: str) -> tuple:
    """(opcode counts, instructions) of the innermost backward-branch loop with an HMMA in it."""
    ins = [(int(a, 16), t.strip()) for a, t in re.findall(r"/\*([0-9a-f]{4,})\*/\s+([^;]*);", text)]
    loops = []
    for addr, t in ins:
        m = re.search(r"\bBRA\b.*?0x([0-9a-f]+)", t)
        if m and int(m.group(1), 16) < addr:
            body = [x for a, x in ins if int(m.group(1), 16) <= a <= addr]
            if any("HMMA" in x for x in body):
                loops.append(body)
    if not loops:
        raise SystemExit("no loop with HMMA found")
    body = min(loops, key=len)
    return collections.Counter(re.sub(r"^@!?U?P\w+\s+", "", x).split()[0] for x in body), len(body)


def mix(files: list, words: int) -> None:
    for f in files:
        counts, n = loop_mix(pathlib.Path(f).read_text())
        pipe = collections.Counter()
        for op, c in counts.items():
            base = op.split(".")[0]
            pipe["ALU" if base in ALU else "FMA" if base in FMA else "other"] += c
        order = ("ALU", "FMA", "other")
        per = f", per word: {n / words:.1f} ({', '.join(f'{p} {pipe[p] / words:.1f}' for p in order)})" if words else ""
        print(f"{f}: K loop {n} instructions ({', '.join(f'{p} {pipe[p]}' for p in order)}){per}")
        print("   " + " ".join(f"{op} {c}" for op, c in counts.most_common()))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    c = sub.add_parser("compile")
    c.add_argument("dir", type=pathlib.Path)
    c.add_argument("fmt", choices=("bf16", "mxfp4"))
    c.add_argument("specs", nargs="+")
    c.add_argument("--tp", type=int, default=16)
    d = sub.add_parser("dump")
    d.add_argument("dir", type=pathlib.Path)
    r = sub.add_parser("regs")
    r.add_argument("dir", type=pathlib.Path)
    m = sub.add_parser("mix")
    m.add_argument("files", nargs="+")
    m.add_argument("--words", type=int, default=0, help="32-bit weight words one trip of the loop decodes")
    a = ap.parse_args()
    if a.cmd == "compile":
        compile_cubins(a.dir, a.fmt, a.specs, a.tp)
    elif a.cmd == "dump":
        dump(a.dir)
    elif a.cmd == "regs":
        regs(a.dir)
    else:
        mix(a.files, a.words)


if __name__ == "__main__":
    main()
