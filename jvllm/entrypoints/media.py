"""Images named by OpenAI chat `image_url` parts -> RGB PIL images (vLLM's MediaConnector).

A URL comes from whoever sends the request, so each kind of URL is checked before anything is
opened: a data URL must hold an image, an http(s) host must be allowed, a file must lie inside
the one folder the operator allowed, and no source may yield more than max_bytes.
"""

import base64
import binascii
import http.client
import os
import stat
import time
import urllib.error
import urllib.parse
import urllib.request
from io import BytesIO

from PIL import Image


class MediaError(ValueError):
    """A media URL that is refused or cannot be loaded; the HTTP layer answers it with a 400."""


DEFAULT_FETCH_TIMEOUT_S = 5.0
DEFAULT_MAX_IMAGE_BYTES = 20 << 20
# The most pixels an image may decode to (a 8192 x 6144 photo), checked before decoding.
MAX_IMAGE_PIXELS = 8192 * 6144
FETCH_TIMEOUT_ENV = "JVLLM_IMAGE_FETCH_TIMEOUT"
MAX_IMAGE_BYTES_ENV = "JVLLM_MAX_IMAGE_BYTES"

_ALLOWED_FORMS = (
    "data:image/<type>;base64,<data>, http(s)://<host>/<path>, "
    "or file:///<path> (with an allowed local media path)"
)
_CHUNK_BYTES = 64 << 10
# vLLM composites a transparent image onto white rather than dropping its alpha channel.
_RGBA_BACKGROUND = (255, 255, 255)


class MediaConnector:
    """Loads the image a URL names, refusing what the operator did not allow.

    allowed_local_media_path: the folder file:// URLs may read from; None refuses file:// URLs.
    allowed_media_domains: the hostnames http(s) URLs may name (exact, case-insensitive);
        None or empty allows any host, as in vLLM.
    fetch_timeout: seconds an http(s) fetch may take; None reads JVLLM_IMAGE_FETCH_TIMEOUT,
        else DEFAULT_FETCH_TIMEOUT_S.
    max_bytes: the most encoded image bytes a URL may yield; None reads JVLLM_MAX_IMAGE_BYTES,
        else DEFAULT_MAX_IMAGE_BYTES.
    """

    def __init__(
        self,
        allowed_local_media_path: str | None = None,
        allowed_media_domains: list[str] | None = None,
        fetch_timeout: float | None = None,
        max_bytes: int | None = None,
    ):
        if allowed_local_media_path is not None:
            if not os.path.isdir(allowed_local_media_path):
                raise ValueError(
                    f"allowed_local_media_path={allowed_local_media_path!r} is not an existing "
                    "directory; allowed: the path of a folder, or None to refuse file:// URLs"
                )
            allowed_local_media_path = os.path.realpath(allowed_local_media_path)
        self.allowed_local_media_path = allowed_local_media_path
        self.allowed_media_domains = (
            [d.lower() for d in allowed_media_domains] if allowed_media_domains else None
        )
        self.fetch_timeout = _fetch_timeout(fetch_timeout)
        self.max_bytes = _max_bytes(max_bytes)

    def fetch_image(self, url: str) -> Image.Image:
        """The image `url` names, in RGB; a MediaError if it is refused or does not decode."""
        if not isinstance(url, str):
            raise MediaError(f"image url must be a string, got {type(url).__name__}")
        scheme = url.partition(":")[0].lower() if ":" in url else ""
        if scheme == "data":
            data = self._read_data_url(url)
        elif scheme in ("http", "https"):
            data = self._read_http(url)
        elif scheme == "file":
            data = self._read_file(url)
        else:
            shown = url if len(url) <= 100 else url[:100] + "..."
            raise MediaError(f"unsupported image url {shown!r}; allowed: {_ALLOWED_FORMS}")
        return _decode_image(data)

    def _read_data_url(self, url: str) -> bytes:
        header, comma, payload = url[len("data:") :].partition(",")
        if not comma:
            raise MediaError("data URL has no ',' before its payload; allowed: " + _ALLOWED_FORMS)
        media_type, *params = [p.strip().lower() for p in header.split(";")]
        if not media_type.startswith("image/"):
            raise MediaError(
                f"data URL of media type {media_type or 'text/plain'!r} is not supported; only "
                "images (image/*) are supported, video and audio are not supported yet"
            )
        if "base64" not in params:
            raise MediaError(f"data URL of {media_type} must be base64: data:{media_type};base64,")
        # Refuse an oversized payload from its length, before decoding allocates it.
        if len(payload) > 4 * (self.max_bytes // 3 + 1):
            raise MediaError(self._too_big("data URL", f"about {len(payload) * 3 // 4}"))
        try:
            data = base64.b64decode(payload, validate=True)
        except binascii.Error as e:
            raise MediaError(f"data URL payload is not valid base64: {e}") from None
        if len(data) > self.max_bytes:
            raise MediaError(self._too_big("data URL", len(data)))
        return data

    def _read_http(self, url: str) -> bytes:
        host = _checked_host(url, self.allowed_media_domains)
        opener = urllib.request.build_opener(_DomainCheckingRedirects(self.allowed_media_domains))
        request = urllib.request.Request(url, headers={"User-Agent": "jvllm"})
        deadline = time.monotonic() + self.fetch_timeout
        try:
            with opener.open(request, timeout=self.fetch_timeout) as response:
                length = response.headers.get("Content-Length")
                if length and length.isdigit() and int(length) > self.max_bytes:
                    raise MediaError(self._too_big(url, int(length)))
                data = self._read_capped(response, url, deadline)
        except MediaError:
            raise
        except urllib.error.HTTPError as e:
            e.close()
            raise MediaError(f"fetching {url} failed: HTTP {e.code} {e.reason}") from None
        except (TimeoutError, urllib.error.URLError) as e:
            if isinstance(e, TimeoutError) or isinstance(e.reason, TimeoutError):
                raise MediaError(f"fetching {url} timed out after {self.fetch_timeout} s") from None
            raise MediaError(f"fetching {url} failed: {e.reason}") from None
        except (OSError, http.client.HTTPException, ValueError) as e:
            raise MediaError(f"fetching {url} (host {host}) failed: {e!r}") from None
        return data

    def _read_capped(self, response, url: str, deadline: float) -> bytes:
        # The socket timeout bounds each wait for bytes; read1 returns whatever arrived, so the
        # deadline, checked between reads, bounds a server that trickles them.
        chunks, num_bytes = [], 0
        while chunk := response.read1(_CHUNK_BYTES):
            num_bytes += len(chunk)
            if num_bytes > self.max_bytes:
                raise MediaError(self._too_big(url, f"more than {num_bytes}"))
            if time.monotonic() > deadline:
                raise MediaError(f"fetching {url} timed out after {self.fetch_timeout} s")
            chunks.append(chunk)
        return b"".join(chunks)

    def _read_file(self, url: str) -> bytes:
        if self.allowed_local_media_path is None:
            raise MediaError(
                "file:// image urls are refused: start the server with "
                "--allowed-local-media-path <folder> (or pass allowed_local_media_path= to LLM) "
                "to allow files inside that folder"
            )
        parts = urllib.parse.urlsplit(url)
        if parts.netloc not in ("", "localhost"):
            raise MediaError(
                f"file url {url!r} names host {parts.netloc!r}; allowed: an absolute path, "
                "file:///<path>"
            )
        raw_path = urllib.request.url2pathname(parts.path)
        if not os.path.isabs(raw_path):
            raise MediaError(f"file url {url!r} is not absolute; allowed: file:///<path>")
        # realpath follows every symlink, so a link that leaves the folder is seen as leaving it.
        path = os.path.realpath(raw_path)
        root = self.allowed_local_media_path
        if os.path.commonpath([root, path]) != root:
            raise MediaError(f"file url {url!r} is outside the allowed local media path {root}")
        try:
            info = os.stat(path)
        except FileNotFoundError:
            raise MediaError(f"file url {url!r}: no such file") from None
        except OSError as e:
            raise MediaError(f"file url {url!r}: {e.strerror}") from None
        if not stat.S_ISREG(info.st_mode):
            raise MediaError(f"file url {url!r} is not a regular file; allowed: an image file")
        if info.st_size > self.max_bytes:
            raise MediaError(self._too_big(url, info.st_size))
        try:
            with open(path, "rb") as f:
                data = f.read(self.max_bytes + 1)
        except OSError as e:
            raise MediaError(f"file url {url!r}: {e.strerror}") from None
        if len(data) > self.max_bytes:
            raise MediaError(self._too_big(url, f"more than {self.max_bytes}"))
        return data

    def _too_big(self, source: str, num_bytes) -> str:
        return (
            f"image from {source} is {num_bytes} bytes; allowed: at most {self.max_bytes} "
            f"(set {MAX_IMAGE_BYTES_ENV} to change)"
        )


class _DomainCheckingRedirects(urllib.request.HTTPRedirectHandler):
    """Follows a redirect only to an allowed host, so a redirect cannot bypass the allow list."""

    def __init__(self, allowed_media_domains: list[str] | None):
        self.allowed_media_domains = allowed_media_domains

    def redirect_request(self, req, fp, code, msg, headers, newurl):
        # urllib would also follow a redirect to ftp://, which fetch_image refuses as a URL.
        if urllib.parse.urlsplit(newurl).scheme.lower() not in ("http", "https"):
            raise MediaError(f"image url {req.full_url} redirects to {newurl!r}; allowed: http(s)")
        _checked_host(newurl, self.allowed_media_domains)
        return super().redirect_request(req, fp, code, msg, headers, newurl)


def _checked_host(url: str, allowed_media_domains: list[str] | None) -> str:
    """The URL's hostname, lower case; a MediaError if it has none or it is not allowed."""
    try:
        host = urllib.parse.urlsplit(url).hostname
    except ValueError as e:
        raise MediaError(f"image url {url!r} is malformed: {e}") from None
    if not host:
        raise MediaError(f"image url {url!r} has no host; allowed: http(s)://<host>/<path>")
    if allowed_media_domains and host not in allowed_media_domains:
        raise MediaError(
            f"image url host {host!r} is not allowed; allowed media domains: "
            f"{', '.join(allowed_media_domains)}"
        )
    return host


def _decode_image(data: bytes) -> Image.Image:
    try:
        image = Image.open(BytesIO(data))  # reads the header alone
    except Exception as e:  # noqa: BLE001 - PIL raises many unrelated types for bad bytes
        raise MediaError(f"could not decode the image: {e}") from None
    width, height = image.size
    if width * height > MAX_IMAGE_PIXELS:  # a few compressed bytes can hold a huge image
        raise MediaError(
            f"the image is {width} x {height} pixels, more than {MAX_IMAGE_PIXELS} in all"
        )
    try:
        image.load()
        if image.mode != "RGBA":
            return image.convert("RGB")
        rgb = Image.new("RGB", image.size, _RGBA_BACKGROUND)
        rgb.paste(image, mask=image.getchannel("A"))
        return rgb
    except Exception as e:  # noqa: BLE001 - PIL raises many unrelated types for bad bytes
        raise MediaError(f"could not decode the image: {e}") from None


def _fetch_timeout(fetch_timeout: float | None) -> float:
    if fetch_timeout is None:
        raw = os.environ.get(FETCH_TIMEOUT_ENV)
        if raw is None:
            return DEFAULT_FETCH_TIMEOUT_S
        try:
            fetch_timeout = float(raw)
        except ValueError:
            fetch_timeout = 0.0
        if not fetch_timeout > 0:
            raise ValueError(f"{FETCH_TIMEOUT_ENV}={raw!r}; allowed: a number of seconds > 0")
    elif not fetch_timeout > 0:
        raise ValueError(f"fetch_timeout={fetch_timeout!r}; allowed: a number of seconds > 0")
    return float(fetch_timeout)


def _max_bytes(max_bytes: int | None) -> int:
    if max_bytes is None:
        raw = os.environ.get(MAX_IMAGE_BYTES_ENV)
        if raw is None:
            return DEFAULT_MAX_IMAGE_BYTES
        if not raw.strip().isdigit() or int(raw) < 1:
            raise ValueError(f"{MAX_IMAGE_BYTES_ENV}={raw!r}; allowed: an integer > 0")
        return int(raw)
    if isinstance(max_bytes, bool) or not isinstance(max_bytes, int) or max_bytes < 1:
        raise ValueError(f"max_bytes={max_bytes!r}; allowed: an integer > 0")
    return max_bytes
