"""The demo model's corpus and tokenizer: the running Python's own standard library.

Every machine that runs moestream has this text and it may be redistributed (PSF
licence), so the demo model needs no download. Files are taken in a fixed order and
split into train/validation by a hash of their path relative to the stdlib folder, so
the split does not depend on the machine or on the size cap. Test suites, third-party
packages and large generated files (codec tables, `pydoc_data`) are left out.

The tokenizer is a byte-level BPE trained with `tokenizers` on the training files only
and saved in the Hugging Face layout that mlx-lm's `TokenizerWrapper` loads.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import sys
import sysconfig
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable

import numpy as np

EOS_TOKEN = "<|endoftext|>"
# Files larger than this are generated tables or data dumps, not code.
MAX_FILE_BYTES = 300_000
# Path components that mark test suites, vendored packages and generated modules.
_SKIP_PARTS = frozenset(
    {"test", "tests", "idle_test", "site-packages", "dist-packages", "encodings", "pydoc_data", "__pycache__"}
)
_TOKENIZER_CONFIG = {
    "tokenizer_class": "PreTrainedTokenizerFast",
    "bos_token": None,
    "eos_token": EOS_TOKEN,
    "pad_token": EOS_TOKEN,
    "add_prefix_space": False,
    "clean_up_tokenization_spaces": False,
    "model_max_length": 4096,
}
# ChatML turns, with tools in the system turn and calls as mlx-lm's `json_tools` parser
# reads them (`<tool_call>{"name": ..., "arguments": {...}}</tool_call>`).
CHAT_TEMPLATE_FILE = Path(__file__).with_name("chat_template.jinja")


@dataclass(frozen=True)
class Corpus:
    """The chosen files' text, split into training and validation documents."""

    root: str
    train_files: tuple[str, ...]
    val_files: tuple[str, ...]
    train_texts: tuple[str, ...]
    val_texts: tuple[str, ...]
    skipped_undecodable: int
    digest: str  # sha256 over (path, text) of every chosen file, in order

    @property
    def train_bytes(self) -> int:
        return sum(len(t.encode()) for t in self.train_texts)

    @property
    def val_bytes(self) -> int:
        return sum(len(t.encode()) for t in self.val_texts)

    def summary(self) -> dict[str, object]:
        """JSON-ready figures that identify the corpus in a training record."""
        return {
            "source": "python standard library (*.py)",
            "root": self.root,
            "python": sys.version.split()[0],
            "train_files": len(self.train_files),
            "val_files": len(self.val_files),
            "train_bytes": self.train_bytes,
            "val_bytes": self.val_bytes,
            "skipped_undecodable": self.skipped_undecodable,
            "sha256": self.digest,
        }


def stdlib_root() -> Path:
    """The standard library folder of the running Python."""
    return Path(sysconfig.get_paths()["stdlib"])


def _path_hash(rel: str) -> int:
    return int.from_bytes(hashlib.sha256(rel.encode()).digest()[:8], "big")


def is_validation(rel: str, val_percent: int) -> bool:
    """Whether the file at stdlib-relative path `rel` belongs to the validation split."""
    return _path_hash(rel) % 100 < val_percent


def source_files(root: Path, *, include_tests: bool = False) -> list[str]:
    """Relative posix paths of the usable *.py files under `root`, sorted."""
    skip = _SKIP_PARTS - ({"test", "tests", "idle_test"} if include_tests else set())
    found = []
    for path in root.rglob("*.py"):
        rel = path.relative_to(root)
        if skip.intersection(rel.parts) or not path.is_file() or path.stat().st_size > MAX_FILE_BYTES:
            continue
        found.append(rel.as_posix())
    return sorted(found)


def collect_corpus(
    max_bytes: int,
    *,
    val_percent: int = 5,
    include_tests: bool = False,
    root: Path | None = None,
) -> Corpus:
    """Read up to `max_bytes` of stdlib source, split by path hash into train/validation.

    Each split gets its share of the cap (`val_percent` for validation). When the cap
    bites, files are taken in the order of their path hash, which samples the whole
    library instead of its alphabetically first packages.
    """
    if max_bytes <= 0:
        raise ValueError(f"max_bytes must be positive, not {max_bytes}")
    if not 0 < val_percent < 50:
        raise ValueError(f"val_percent must be between 1 and 49, not {val_percent}")
    root = root or stdlib_root()
    if not root.is_dir():
        raise FileNotFoundError(f"the standard library folder {root} does not exist; is this Python complete?")
    room = {True: max_bytes * val_percent // 100, False: max_bytes - max_bytes * val_percent // 100}
    chosen: list[tuple[str, str]] = []
    undecodable = 0
    for rel in sorted(source_files(root, include_tests=include_tests), key=_path_hash):
        split = is_validation(rel, val_percent)
        size = (root / rel).stat().st_size
        if size > room[split]:
            continue
        try:
            text = (root / rel).read_bytes().decode("utf-8")
        except UnicodeDecodeError:
            undecodable += 1
            continue
        chosen.append((rel, text))
        room[split] -= size
    chosen.sort()
    digest = hashlib.sha256()
    for rel, text in chosen:
        digest.update(rel.encode() + b"\0" + text.encode() + b"\0")
    train = [(r, t) for r, t in chosen if not is_validation(r, val_percent)]
    val = [(r, t) for r, t in chosen if is_validation(r, val_percent)]
    if not train or not val:
        raise ValueError(
            f"the corpus under {root} ({len(chosen)} files within {max_bytes} bytes) is too small "
            "to give both a training and a validation file; raise the size cap"
        )
    return Corpus(
        root=str(root),
        train_files=tuple(r for r, _ in train),
        val_files=tuple(r for r, _ in val),
        train_texts=tuple(t for _, t in train),
        val_texts=tuple(t for _, t in val),
        skipped_undecodable=undecodable,
        digest=digest.hexdigest(),
    )


def train_tokenizer(texts: Iterable[str], vocab_size: int, out_dir: str | Path):
    """Train a byte-level BPE on `texts`, save it to `out_dir`, and return it.

    Writes `tokenizer.json` and `tokenizer_config.json`; `<|endoftext|>` is id 0 and is
    both the end-of-sequence and the document separator.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    if vocab_size < 257:
        raise ValueError(f"vocab_size must exceed the 256 byte tokens, not {vocab_size}")
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    tok.save(str(out_dir / "tokenizer.json"))
    _write_tokenizer_config(out_dir)
    return tok


def reuse_tokenizer(src_dir: str | Path, out_dir: str | Path):
    """The trained tokenizer of a model folder or store, saved to `out_dir` with this
    recipe's tokenizer config and chat template, and returned (a fine-tune keeps the
    vocabulary its embeddings were trained with)."""
    from tokenizers import Tokenizer

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(Path(src_dir) / "tokenizer.json", out_dir / "tokenizer.json")
    tok = Tokenizer.from_file(str(out_dir / "tokenizer.json"))
    if tok.token_to_id(EOS_TOKEN) != 0:
        raise ValueError(f"{src_dir}: its tokenizer does not have {EOS_TOKEN} as id 0; it is not the demo's")
    _write_tokenizer_config(out_dir)
    return tok


def _write_tokenizer_config(out_dir: Path) -> None:
    config = {**_TOKENIZER_CONFIG, "chat_template": CHAT_TEMPLATE_FILE.read_text()}
    (out_dir / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")


def tokenizer_file_names() -> tuple[str, ...]:
    """The files `train_tokenizer` writes, to copy into model folders."""
    return ("tokenizer.json", "tokenizer_config.json")


def encode_documents(tokenizer, texts: Iterable[str]) -> np.ndarray:
    """One int32 token stream: every document followed by `<|endoftext|>`."""
    eos = tokenizer.token_to_id(EOS_TOKEN)
    if eos is None:
        raise ValueError(f"the tokenizer has no {EOS_TOKEN} token")
    parts = []
    for enc in tokenizer.encode_batch(list(texts)):
        parts.append(np.asarray(enc.ids, dtype=np.int32))
        parts.append(np.array([eos], dtype=np.int32))
    if not parts:
        raise ValueError("no documents to encode")
    return np.concatenate(parts)
