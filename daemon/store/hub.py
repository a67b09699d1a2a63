"""A Hugging Face model repository, as `moestreamctl pull` and `plan REPO_ID` read it.

Everything goes through `huggingface_hub`'s public API: the file listing with sizes and
hashes (`HfApi.model_info(files_metadata=True)`), each weight file's safetensors header
by a range request (`HfApi.parse_safetensors_file_metadata`), and each file's download
(`get_hf_file_metadata` for where and how large, `http_get` for the bytes). The download
goes to `NAME.incomplete` beside its destination and continues from that file's length
when it is started again, in this process (`http_get` resumes a cut connection itself)
or in a later one; a finished file is checked against the hub's hash (the LFS sha256, or
the git blob id of a small file) before it takes its name, and fetched once more where it
does not match. `HF_ENDPOINT` (or `endpoint`) points it at another hub, a test's local one.
No MLX here: the CLI reads `default_store_dir` and `is_repo_id` before anything loads.
"""

from __future__ import annotations

import fnmatch
import functools
import hashlib
import os
import re
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping, TextIO
from urllib.parse import urlparse

from ...shared.settings import format_size
from ...shared.store_format import StoreError

# What a download fetches of a repository, as mlx-lm's own download does
# (mlx_lm.utils.DEFAULT_ALLOW_PATTERNS): the config, the weights, the tokenizer.
ALLOW_PATTERNS = (
    "*.json",
    "model*.safetensors",
    "*.py",
    "tokenizer.model",
    "*.tiktoken",
    "tiktoken.model",
    "*.txt",
    "*.jsonl",
    "*.jinja",
)
WEIGHTS_PATTERN = "model*.safetensors"
INCOMPLETE = ".incomplete"
_REPO_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*/[A-Za-z0-9_.-]+$")
_HASH_CHUNK = 16 << 20


def is_repo_id(text: str | os.PathLike | None) -> bool:
    """Whether `text` names a hub repository (owner/name) rather than a folder: of that
    form, and no such path exists here."""
    if text is None:
        return False
    text = str(text)
    return bool(_REPO_ID.match(text)) and ".." not in text and not Path(text).expanduser().exists()


def default_store_dir(repo_id: str, revision: str | None = None, env: Mapping[str, str] | None = None) -> Path:
    """Where `pull REPO_ID` puts the store unless told: the user's data folder
    ($XDG_DATA_HOME, else ~/.local/share), `moestream/stores/OWNER--NAME` (`@REVISION`
    added where one is asked for)."""
    env = os.environ if env is None else env
    base = env.get("XDG_DATA_HOME") or str(Path(env.get("HOME", "~")).expanduser() / ".local" / "share")
    name = repo_id.replace("/", "--") + (f"@{revision}" if revision else "")
    return Path(base) / "moestream" / "stores" / name


@dataclass(frozen=True)
class RepoFile:
    name: str
    size: int
    sha256: str | None  # an LFS file's content hash
    blob_id: str | None  # a small file's git blob id (sha1 of "blob SIZE\0" + content)

    @property
    def is_weights(self) -> bool:
        return fnmatch.fnmatch(self.name, WEIGHTS_PATTERN)


@dataclass(frozen=True)
class RepoListing:
    """A repository at one commit: the files a pull fetches (top level, ALLOW_PATTERNS)."""

    repo_id: str
    commit: str
    files: tuple[RepoFile, ...]

    @property
    def weights(self) -> list[RepoFile]:
        return sorted((f for f in self.files if f.is_weights), key=lambda f: f.name)

    @property
    def small(self) -> list[RepoFile]:
        """Everything but the weights, config.json first."""
        return sorted((f for f in self.files if not f.is_weights), key=lambda f: (f.name != "config.json", f.name))

    def file(self, name: str) -> RepoFile | None:
        return next((f for f in self.files if f.name == name), None)


def _why(e: BaseException) -> str:
    """A hub or network failure in a few words."""
    from huggingface_hub.errors import GatedRepoError, RepositoryNotFoundError, RevisionNotFoundError

    if isinstance(e, GatedRepoError):
        return "it is gated: accept its terms on the hub and log in (`hf auth login`)"
    if isinstance(e, RepositoryNotFoundError):
        return "no such repository (or it is private: log in with `hf auth login`)"
    if isinstance(e, RevisionNotFoundError):
        return "no such revision"
    return f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else 'no answer'}"


def hub_error(repo_id: str, e: BaseException) -> StoreError:
    """A hub or network failure as one line naming the repository."""
    return StoreError(f"{repo_id}: {_why(e)}")


def _hub_errors() -> tuple[type[BaseException], ...]:
    import httpx2
    from huggingface_hub.errors import HfHubHTTPError, SafetensorsParsingError

    return (HfHubHTTPError, SafetensorsParsingError, httpx2.HTTPError, OSError, ValueError)


def list_repo(repo_id: str, revision: str | None = None, endpoint: str | None = None) -> RepoListing:
    """The repository's files at `revision` (default: its main branch), with sizes and
    hashes, and the commit they belong to (a later step asks for that commit, so that a
    push in between changes nothing)."""
    from huggingface_hub import HfApi

    try:
        info = HfApi(endpoint=endpoint).model_info(repo_id, revision=revision, files_metadata=True)
    except _hub_errors() as e:
        raise hub_error(repo_id, e) from None
    files = []
    for s in info.siblings or []:
        if "/" in s.rfilename or not any(fnmatch.fnmatch(s.rfilename, p) for p in ALLOW_PATTERNS):
            continue
        size = s.lfs.size if s.lfs is not None else s.size
        if size is None:
            raise StoreError(f"{repo_id}: the hub lists {s.rfilename} without its size")
        files.append(RepoFile(s.rfilename, int(size), s.lfs.sha256 if s.lfs is not None else None, s.blob_id))
    if info.sha is None:
        raise StoreError(f"{repo_id}: the hub did not say which commit {revision or 'main'} is")
    listing = RepoListing(repo_id, info.sha, tuple(files))
    if listing.file("config.json") is None:
        raise StoreError(f"{repo_id}: no config.json at {revision or 'main'}; is this a model repository?")
    if not listing.weights:
        raise StoreError(f"{repo_id}: no {WEIGHTS_PATTERN} weight files; mlx-lm cannot load this repository")
    return listing


@dataclass(frozen=True)
class HeaderTensor:
    dtype: str  # the safetensors name: "BF16", "U32"
    shape: tuple[int, ...]
    data_offsets: tuple[int, int]


@dataclass(frozen=True)
class WeightHeader:
    """One weight file's safetensors header: its tensors and metadata."""

    tensors: dict[str, HeaderTensor]
    metadata: dict[str, str] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {
            "tensors": {k: [t.dtype, list(t.shape), list(t.data_offsets)] for k, t in self.tensors.items()},
            "metadata": self.metadata,
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> WeightHeader:
        tensors = {k: HeaderTensor(v[0], tuple(v[1]), (v[2][0], v[2][1])) for k, v in data["tensors"].items()}
        return cls(tensors, dict(data.get("metadata") or {}))


def weight_headers(listing: RepoListing, endpoint: str | None = None) -> dict[str, WeightHeader]:
    """{weight file: its header}, each read with a range request (no weights downloaded)."""
    from huggingface_hub import HfApi

    api = HfApi(endpoint=endpoint)
    out = {}
    for f in listing.weights:
        try:
            meta = api.parse_safetensors_file_metadata(listing.repo_id, f.name, revision=listing.commit)
        except _hub_errors() as e:
            raise hub_error(listing.repo_id, e) from None
        out[f.name] = WeightHeader(
            {
                name: HeaderTensor(t.dtype, tuple(t.shape), (int(t.data_offsets[0]), int(t.data_offsets[1])))
                for name, t in meta.tensors.items()
            },
            dict(meta.metadata or {}),
        )
    return out


def file_digest(path: Path, f: RepoFile) -> tuple[str, str]:
    """(kind, hex digest) of the downloaded `path` as the hub gives `f`'s: its sha256 for
    an LFS file, else its git blob id."""
    if f.sha256 is not None:
        h, kind = hashlib.sha256(), "sha256"
    else:
        h, kind = hashlib.sha1(b"blob %d\0" % path.stat().st_size), "git blob id"
    with open(path, "rb") as fh:
        while chunk := fh.read(_HASH_CHUNK):
            h.update(chunk)
    return kind, h.hexdigest()


class _Bytes:
    """Stands in for `http_get`'s tqdm: passes each chunk's length on."""

    def __init__(self, sink: Callable[[int], None], **_: Any) -> None:
        self._sink = sink

    def __enter__(self) -> _Bytes:
        return self

    def __exit__(self, *exc: Any) -> None:
        return None

    def update(self, n: int) -> None:
        self._sink(n)


def fetch_file(
    listing: RepoListing,
    f: RepoFile,
    folder: Path,
    on_bytes: Callable[[int], None] = lambda n: None,
    say: Callable[[str], None] = lambda line: print(line, file=sys.stderr),
    endpoint: str | None = None,
) -> Path:
    """Download `f` into `folder` (continuing a `NAME.incomplete` left there), check it
    against the hub's hash, and give it its name; fetched once more where it does not
    match, then refused. `on_bytes(n)`: n more bytes arrived (negative: n bytes of a
    partial file were dropped)."""
    from huggingface_hub import get_hf_file_metadata, hf_hub_url
    from huggingface_hub.file_download import http_get
    from huggingface_hub.utils import build_hf_headers

    dest = folder / f.name
    part = folder / (f.name + INCOMPLETE)
    want = f.sha256 or f.blob_id
    url = hf_hub_url(listing.repo_id, f.name, revision=listing.commit, endpoint=endpoint)
    for attempt in (1, 2):
        try:
            meta = get_hf_file_metadata(url, endpoint=endpoint)
            have = part.stat().st_size if part.exists() else 0
            if have > f.size:  # not this file's beginning: start again
                part.unlink()
                on_bytes(-have)
                have = 0
            # The token goes to the hub, not to a storage host it sends the download to.
            on_hub = urlparse(meta.location).netloc == urlparse(url).netloc
            with open(part, "ab") as out:
                http_get(
                    meta.location,
                    out,
                    resume_size=have,
                    headers=build_hf_headers() if on_hub else build_hf_headers(token=False),
                    expected_size=f.size,
                    tqdm_class=functools.partial(_Bytes, on_bytes),  # type: ignore[arg-type]
                )
        except _hub_errors() as e:
            raise StoreError(
                f"{listing.repo_id}: downloading {f.name} failed ({_why(e)}); "
                "run the pull again to continue where it stopped"
            ) from None
        kind, got = file_digest(part, f)
        if want is None or got == want:
            os.replace(part, dest)
            return dest
        part.unlink()
        on_bytes(-f.size)
        if attempt == 1:
            say(f"{f.name}: its {kind} is {got}, not the hub's {want}: fetching it again")
    raise StoreError(
        f"{listing.repo_id}: {f.name} arrived twice with {kind} {got}, not the hub's {want}; "
        "nothing was kept of it: check the network (a proxy that alters downloads?) and pull again"
    )


class Progress:
    """Bytes, rate and time left of a pull, on stderr: one line rewritten on a terminal,
    else a line every `every` seconds (and at the end)."""

    def __init__(self, total: int = 0, stream: TextIO | None = None, every: float = 5.0) -> None:
        self._stream = stream or sys.stderr
        self._tty = self._stream.isatty()
        self._every = 0.25 if self._tty else every
        self._last = 0.0
        self.note = ""
        self.start(total, 0)

    def start(self, total: int, done: int) -> None:
        """Count from here: `done` of `total` bytes are there already (the rate leaves them out)."""
        self.total, self.done = total, done
        self._start, self._start_done = time.monotonic(), done

    def add(self, n: int) -> None:
        self.done += n
        now = time.monotonic()
        if now - self._last >= self._every:
            self._last = now
            self._print(self.line(now))

    def line(self, now: float | None = None) -> str:
        elapsed = (now or time.monotonic()) - self._start
        rate = (self.done - self._start_done) / elapsed if elapsed > 0 else 0.0
        left = (self.total - self.done) / rate if rate > 0 else None
        eta = "--" if left is None else time.strftime("%H:%M:%S", time.gmtime(left))
        note = f" ({self.note})" if self.note else ""
        return f"{format_size(self.done)} of {format_size(self.total)}, {format_size(rate)}/s, {eta} left{note}"

    def _print(self, text: str) -> None:
        if self._tty:
            self._stream.write("\r" + text.ljust(90)[:200])
        else:
            self._stream.write(text + "\n")
        self._stream.flush()

    def say(self, text: str) -> None:
        """A line of its own (a file converted, a file fetched again)."""
        if self._tty:
            self._stream.write("\r" + " " * 90 + "\r")
        self._stream.write(text + "\n")
        self._stream.flush()

    def finish(self) -> None:
        self._last = 0.0
        self._print(self.line())
        if self._tty:
            self._stream.write("\n")
            self._stream.flush()
