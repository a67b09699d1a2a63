"""A local Hugging Face Hub for the pull tests: the routes `huggingface_hub` calls, serving
model folders in the hub's layout, with faults to inject.

Built from what huggingface_hub 2.x requests (its source: `HfApi.model_info`,
`get_hf_file_metadata`, `http_get`, `parse_safetensors_file_metadata`):

- `GET /api/models/OWNER/NAME[/revision/REV]?blobs=true`: the model info, its `sha` (the
  commit) and `siblings`, each with `size`, `blobId` and, for an LFS file, `lfs`
  {`size`, `sha256`, `pointerSize`};
- `HEAD /OWNER/NAME/resolve/REV/FILE`: `X-Repo-Commit`, `ETag` (an LFS file's sha256, else
  its git blob id), `X-Linked-Etag` and `X-Linked-Size` for an LFS file, `Content-Length`;
- `GET` of the same: the bytes, or with `Range: bytes=A-[B]` a 206 and `Content-Range`.

As on the hub, weight files (`*.safetensors`) are LFS files, the rest plain git blobs; an
unknown repository or file is a 404 with the `X-Error-Code` huggingface_hub reads. Faults:
`cut` (a file's next GET sends part of its body, then closes the connection), `corrupt` (its
next GETs send other bytes of the same length), `stall` (its next GET sends part of the body,
says so on `stalled`, and waits for `release`); each on a GET of the whole file (no Range:
not a header's read, nor a download that continues). Every request is kept in `requests`.
"""

from __future__ import annotations

import hashlib
import json
import re
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlparse

_INFO = re.compile(r"^/api/models/([^/]+/[^/]+?)(?:/revision/([^/]+))?$")
_RESOLVE = re.compile(r"^/([^/]+/[^/]+)/resolve/([^/]+)/(.+)$")


def is_lfs(name: str) -> bool:
    return name.endswith(".safetensors")


def blob_id(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


@dataclass(frozen=True)
class Sparse:
    """A weight file known by its header alone (the q30 repository's, tests/data/hub):
    its header, then zeros to its size. The hub lists a stand-in sha256 (the header's):
    no test downloads one whole."""

    head: bytes
    size: int

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, s: slice) -> bytes:
        start, stop, _ = s.indices(self.size)
        if stop <= start:
            return b""
        part = self.head[start:stop]
        return part + b"\0" * (stop - start - len(part))


Blob = bytes | Sparse


def sha256(data: Blob) -> str:
    return hashlib.sha256(data.head if isinstance(data, Sparse) else data).hexdigest()


@dataclass
class HubRepo:
    repo_id: str
    commit: str
    files: dict[str, Blob]


@dataclass(frozen=True)
class Seen:
    """One request the hub answered."""

    method: str
    repo_id: str
    file: str  # "" for the model info
    range: str | None


@dataclass
class FakeHub:
    repos: dict[str, HubRepo] = field(default_factory=dict)
    requests: list[Seen] = field(default_factory=list)
    cut: dict[str, int] = field(default_factory=dict)  # file -> bytes sent before the cut (once)
    corrupt: dict[str, int] = field(default_factory=dict)  # file -> GETs left to corrupt
    stall: dict[str, int] = field(default_factory=dict)  # file -> bytes sent before the stall (once)
    stalled: threading.Event = field(default_factory=threading.Event)
    release: threading.Event = field(default_factory=threading.Event)
    url: str = ""

    def add(self, repo_id: str, folder: Path) -> HubRepo:
        """Serve the files of `folder` as `repo_id`."""
        return self.add_files(repo_id, {p.name: p.read_bytes() for p in sorted(folder.iterdir()) if p.is_file()})

    def add_files(self, repo_id: str, files: dict[str, Blob]) -> HubRepo:
        commit = hashlib.sha1(repo_id.encode() + "".join(map(sha256, files.values())).encode()).hexdigest()
        self.repos[repo_id] = HubRepo(repo_id, commit, files)
        return self.repos[repo_id]

    def gets(self, file: str) -> list[Seen]:
        """The GETs of `file`'s bytes (the header reads of `plan` and a pull's first step
        excluded: a range that starts at 0 and ends within the first 100001 bytes)."""
        return [
            r
            for r in self.requests
            if r.method == "GET" and r.file == file and not (r.range or "").startswith("bytes=0-100000")
        ]

    def __enter__(self) -> FakeHub:
        hub = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: object) -> None:
                pass

            def do_HEAD(self) -> None:
                hub._answer(self, head=True)

            def do_GET(self) -> None:
                hub._answer(self, head=False)

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.release.set()
        self._server.shutdown()
        self._server.server_close()

    # ---- answers -----------------------------------------------------------------------

    def _missing(self, h: BaseHTTPRequestHandler, code: str) -> None:
        body = json.dumps({"error": code}).encode()
        h.send_response(404)
        h.send_header("X-Error-Code", code)
        h.send_header("X-Error-Message", code)
        h.send_header("Content-Type", "application/json")
        h.send_header("Content-Length", str(len(body)))
        h.end_headers()
        h.wfile.write(body)

    def _answer(self, h: BaseHTTPRequestHandler, head: bool) -> None:
        path = unquote(urlparse(h.path).path)
        if m := _INFO.match(path):
            self.requests.append(Seen(h.command, m.group(1), "", None))
            repo = self.repos.get(m.group(1))
            if repo is None:
                return self._missing(h, "RepoNotFound")
            if m.group(2) not in (None, "main", repo.commit):
                return self._missing(h, "RevisionNotFound")
            return self._json(h, self._info(repo))
        m = _RESOLVE.match(path)
        if m is None:
            return self._missing(h, "EntryNotFound")
        repo = self.repos.get(m.group(1))
        self.requests.append(Seen(h.command, m.group(1), m.group(3), h.headers.get("Range")))
        if repo is None:
            return self._missing(h, "RepoNotFound")
        if m.group(2) not in ("main", repo.commit):
            return self._missing(h, "RevisionNotFound")
        name = m.group(3)
        data = repo.files.get(name)
        if data is None:
            return self._missing(h, "EntryNotFound")
        self._file(h, repo, name, data, head)

    def _info(self, repo: HubRepo) -> dict[str, object]:
        siblings = []
        for name, data in repo.files.items():
            s: dict[str, object] = {"rfilename": name, "size": len(data)}
            if is_lfs(name):
                # An LFS file's blob is its pointer, whose id no client checks.
                s["blobId"] = hashlib.sha1(name.encode()).hexdigest()
                s["lfs"] = {"size": len(data), "sha256": sha256(data), "pointerSize": 134}
            else:
                s["blobId"] = blob_id(bytes(data))
            siblings.append(s)
        return {"id": repo.repo_id, "modelId": repo.repo_id, "sha": repo.commit, "private": False, "siblings": siblings}

    def _json(self, h: BaseHTTPRequestHandler, data: object) -> None:
        body = json.dumps(data).encode()
        h.send_response(200)
        h.send_header("Content-Type", "application/json")
        h.send_header("Content-Length", str(len(body)))
        h.end_headers()
        h.wfile.write(body)

    def _file(self, h: BaseHTTPRequestHandler, repo: HubRepo, name: str, data: Blob, head: bool) -> None:
        etag = sha256(data) if is_lfs(name) else blob_id(bytes(data))
        start, end = 0, len(data) - 1
        wanted = h.headers.get("Range")
        if wanted and not head:
            a, _, b = wanted.removeprefix("bytes=").partition("-")
            start, end = int(a), min(int(b), len(data) - 1) if b else len(data) - 1
        body = data[start : end + 1]
        if not head and not wanted and self.corrupt.get(name, 0) > 0:
            self.corrupt[name] -= 1
            body = bytes(x ^ 0xFF for x in body)
        h.send_response(206 if wanted and not head else 200)
        h.send_header("X-Repo-Commit", repo.commit)
        h.send_header("ETag", f'"{etag}"')
        if is_lfs(name):
            h.send_header("X-Linked-Etag", f'"{etag}"')
            h.send_header("X-Linked-Size", str(len(data)))
        h.send_header("Accept-Ranges", "bytes")
        if wanted and not head:
            h.send_header("Content-Range", f"bytes {start}-{end}/{len(data)}")
        h.send_header("Content-Length", str(len(data) if head else len(body)))
        h.end_headers()
        if head:
            return
        cut = self.cut.pop(name, None) if not wanted else None
        stall = self.stall.pop(name, None) if not wanted else None
        if cut is not None:
            h.wfile.write(body[:cut])
            h.wfile.flush()
            h.close_connection = True
            h.connection.shutdown(2)
            return
        if stall is not None:
            h.wfile.write(body[:stall])
            h.wfile.flush()
            self.stalled.set()
            self.release.wait(60)
            h.close_connection = True
            return
        h.wfile.write(body)
