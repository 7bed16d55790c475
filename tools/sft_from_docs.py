"""A small instruction set from the Python documentation's reStructuredText sources (Debian's
``python3.11-doc``: /usr/share/doc/python3.11/html/_sources), for `minifloat train MODEL --sft`.

Every ``.. function::`` / ``.. method::`` directive of the library reference whose description
starts with a plain sentence becomes one record: the user asks what the signature does, the
assistant answers with the description's first sentence (markup removed). Deterministic: files
and directives in sorted order, the first N kept.

    python tools/sft_from_docs.py /usr/share/doc/python3.11/html/_sources/library --out docs_sft.jsonl --limit 400
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

DIRECTIVE = re.compile(r"^\.\. (function|method):: (.+)$")
ROLE = re.compile(r":[a-z:]+:`~?([^`<]+?)(?: <[^>]+>)?`")  # :func:`len` → len


def _plain(text: str) -> str:
    text = ROLE.sub(r"\1", text)
    return re.sub(r"\s+", " ", text.replace("``", "").replace("*", "")).strip()


def records(folder: Path, limit: int) -> list[dict]:
    out = []
    for path in sorted(folder.rglob("*.rst.txt")):
        lines = path.read_text(encoding="utf-8", errors="replace").splitlines()
        for i, line in enumerate(lines):
            m = DIRECTIVE.match(line)
            if not m:
                continue
            body, j = [], i + 1
            while j < len(lines) and (not lines[j].strip() or lines[j].startswith("   ")):
                if lines[j].strip().startswith((".. ", ":")) and not body:
                    j += 1
                    continue
                if not lines[j].strip() and body:
                    break
                if lines[j].strip():
                    body.append(lines[j].strip())
                j += 1
            text = _plain(" ".join(body))
            first = re.split(r"(?<=[.!?])\s", text, maxsplit=1)[0]
            if not (20 <= len(first) <= 300) or not first[0].isupper():
                continue
            question = f"What does `{m.group(2).strip()}` do in Python ({path.stem.removesuffix('.rst')})?"
            out.append({"messages": [{"role": "user", "content": question}, {"role": "assistant", "content": first}]})
            if len(out) >= limit:
                return out
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("folder", type=Path)
    p.add_argument("--out", required=True, type=Path)
    p.add_argument("--limit", type=int, default=400)
    a = p.parse_args()
    rows = records(a.folder, a.limit)
    a.out.write_text("".join(json.dumps(r) + "\n" for r in rows))
    print(f"{len(rows)} records → {a.out}")


if __name__ == "__main__":
    main()
