"""minilang: a small language prl's tiny models can write (their alphabet has no brackets or quotes),
run by this file inside the sandbox with the standard library only.

A program is statements separated by commas, each `OP WORD`: `p WORD` prints WORD, `r WORD` prints
it reversed, `s WORD` prints its letters sorted; the outputs are joined. The harness reads the target
on stdin's first line and the program after it, runs the program, and prints `ok` (exit 0) when the
output is the target, else `got:OUTPUT want:TARGET` (exit 1), or `err:...` for a program it cannot
run (exit 2), as a test runner would.

Batch mode (stdin's first line `#batch`, then one JSON object `{"target": ..., "program": ...}` a
line): each program runs as above and its answer is one JSON line `{"out": ..., "code": ...}`. The
programs are data to this interpreter, so many can share one sandbox execution (`prl.envs.code_env`).
"""

import sys

OPS = {"p": lambda w: w, "r": lambda w: w[::-1], "s": lambda w: "".join(sorted(w))}


def run(program: str) -> str:
    out = []
    for stmt in (s.strip() for s in program.split(",")):
        if not stmt:
            continue
        op, _, word = stmt.partition(" ")
        if op not in OPS:
            raise ValueError(f"unknown op {op[:8]}")
        if not word.strip():
            raise ValueError(f"op {op} needs a word")
        out.append(OPS[op](word.strip()))
    if not out:
        raise ValueError("empty program")
    return "".join(out)


def judge(target: str, program: str) -> tuple[str, int]:
    try:
        got = run(program.strip())
    except ValueError as e:
        return f"err:{e}", 2
    if got == target.strip():
        return "ok", 0
    return f"got:{got} want:{target.strip()}", 1


def main() -> int:
    target, _, program = sys.stdin.read().partition("\n")
    if target.strip() == "#batch":
        import json

        for line in program.splitlines():
            item = json.loads(line)
            out, code = judge(str(item["target"]), str(item["program"]))
            print(json.dumps({"out": out, "code": code}))
        return 0
    out, code = judge(target, program)
    print(out)
    return code


if __name__ == "__main__":
    sys.exit(main())
