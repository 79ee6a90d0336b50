"""MediaConnector: each kind of image URL loads, and each refusal happens before any read."""

import base64
import http.server
import os
import threading
import time
from io import BytesIO

import pytest
from PIL import Image

from jvllm.entrypoints.media import MediaConnector, MediaError


def _image() -> Image.Image:
    pixels = bytes(v for i in range(12) for v in (i * 20, 255 - i * 20, i * 7))
    return Image.frombytes("RGB", (4, 3), pixels)


def _encoded(image: Image.Image, fmt: str) -> bytes:
    buffer = BytesIO()
    image.save(buffer, format=fmt)
    return buffer.getvalue()


def _data_url(data: bytes, media_type: str = "image/png") -> str:
    return f"data:{media_type};base64,{base64.b64encode(data).decode()}"


PNG = _encoded(_image(), "PNG")


class _Server:
    """A loopback HTTP server whose paths map to (status, body, delay_s, send_length);
    a 3xx status sends its body as the Location."""

    def __init__(self):
        self.routes: dict[str, tuple[int, bytes, float, bool]] = {}
        self.num_requests = 0
        server = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self):
                server.num_requests += 1
                status, body, delay_s, send_length = server.routes.get(
                    self.path, (404, b"not found", 0.0, True)
                )
                time.sleep(max(delay_s, 0.0))
                try:
                    self.send_response(status)
                    if 300 <= status < 400:
                        self.send_header("Location", body.decode())
                    if send_length:
                        self.send_header("Content-Length", str(len(body)))
                    self.end_headers()
                    if delay_s >= 0:
                        self.wfile.write(body)
                    for i in range(len(body) if delay_s < 0 else 0):  # a byte each -delay_s
                        self.wfile.write(body[i : i + 1])
                        self.wfile.flush()
                        time.sleep(-delay_s)
                except OSError:
                    pass  # the client gave up (the timeout test)

            def log_message(self, *args):
                pass

        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        # A short poll lets shutdown() return at once instead of after serve_forever's 0.5 s.
        self.thread = threading.Thread(
            target=self.httpd.serve_forever, kwargs={"poll_interval": 0.02}, daemon=True
        )
        self.thread.start()

    def url(self, path: str) -> str:
        return f"http://127.0.0.1:{self.httpd.server_port}{path}"

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def server(monkeypatch):
    # A proxy from the environment would take loopback requests elsewhere.
    for name in ("http_proxy", "https_proxy", "all_proxy", "HTTP_PROXY", "HTTPS_PROXY"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.delenv("ALL_PROXY", raising=False)
    s = _Server()
    yield s
    s.close()


def test_png_data_url_decodes_to_the_same_pixels():
    image = MediaConnector().fetch_image(_data_url(PNG))
    assert image.mode == "RGB"
    assert image.tobytes() == _image().tobytes()


def test_jpeg_data_url_decodes_to_rgb_of_the_same_size():
    image = MediaConnector().fetch_image(_data_url(_encoded(_image(), "JPEG"), "image/jpeg"))
    assert (image.mode, image.size) == ("RGB", (4, 3))


def test_transparent_pixels_become_white_as_in_vllm():
    rgba = Image.new("RGBA", (2, 1), (10, 20, 30, 0))
    image = MediaConnector().fetch_image(_data_url(_encoded(rgba, "PNG")))
    assert image.tobytes() == bytes([255] * 6)


def test_bad_base64_is_refused():
    with pytest.raises(MediaError, match="not valid base64"):
        MediaConnector().fetch_image("data:image/png;base64,not*base64!")


@pytest.mark.parametrize("media_type", ["text/plain", "audio/wav", "video/mp4"])
def test_data_url_that_is_not_an_image_is_refused(media_type):
    with pytest.raises(MediaError, match="only images.*not supported yet"):
        MediaConnector().fetch_image(_data_url(b"hello", media_type))


def test_garbage_bytes_typed_as_png_are_refused():
    with pytest.raises(MediaError, match="could not decode the image"):
        MediaConnector().fetch_image(_data_url(b"\x00not a png at all"))


def test_data_url_over_max_bytes_is_refused():
    with pytest.raises(MediaError, match="at most 16"):
        MediaConnector(max_bytes=16).fetch_image(_data_url(PNG))


def test_file_under_the_allowed_folder_loads(tmp_path):
    (tmp_path / "a.png").write_bytes(PNG)
    connector = MediaConnector(allowed_local_media_path=str(tmp_path))
    image = connector.fetch_image((tmp_path / "a.png").as_uri())
    assert image.tobytes() == _image().tobytes()


def test_file_url_without_an_allowed_folder_is_refused(tmp_path):
    (tmp_path / "a.png").write_bytes(PNG)
    with pytest.raises(MediaError, match="--allowed-local-media-path"):
        MediaConnector().fetch_image((tmp_path / "a.png").as_uri())


def test_dotdot_escape_from_the_allowed_folder_is_refused(tmp_path):
    allowed = tmp_path / "allowed"
    allowed.mkdir()
    (tmp_path / "secret.png").write_bytes(PNG)
    connector = MediaConnector(allowed_local_media_path=str(allowed))
    with pytest.raises(MediaError, match="outside the allowed local media path"):
        connector.fetch_image(f"file://{allowed}/../secret.png")


def test_symlink_leaving_the_allowed_folder_is_refused(tmp_path):
    allowed = tmp_path / "allowed"
    allowed.mkdir()
    # A FIFO: opening it would block, so the test would hang if the refusal came after an open.
    os.mkfifo(tmp_path / "outside")
    (allowed / "link.png").symlink_to(tmp_path / "outside")
    connector = MediaConnector(allowed_local_media_path=str(allowed))
    with pytest.raises(MediaError, match="outside the allowed local media path"):
        connector.fetch_image((allowed / "link.png").as_uri())


def test_missing_file_is_refused(tmp_path):
    connector = MediaConnector(allowed_local_media_path=str(tmp_path))
    with pytest.raises(MediaError, match="no such file"):
        connector.fetch_image((tmp_path / "missing.png").as_uri())


def test_file_over_max_bytes_is_refused(tmp_path):
    (tmp_path / "a.png").write_bytes(PNG)
    connector = MediaConnector(allowed_local_media_path=str(tmp_path), max_bytes=16)
    with pytest.raises(MediaError, match="at most 16"):
        connector.fetch_image((tmp_path / "a.png").as_uri())


def test_allowed_local_media_path_must_be_an_existing_folder(tmp_path):
    with pytest.raises(ValueError, match="allowed_local_media_path"):
        MediaConnector(allowed_local_media_path=str(tmp_path / "missing"))


def test_http_image_loads(server):
    server.routes["/a.png"] = (200, PNG, 0.0, True)
    image = MediaConnector().fetch_image(server.url("/a.png"))
    assert image.tobytes() == _image().tobytes()


@pytest.mark.parametrize("send_length", [True, False], ids=["content-length", "streamed"])
def test_http_body_over_max_bytes_is_refused(server, send_length):
    server.routes["/big.png"] = (200, PNG * 4, 0.0, send_length)
    with pytest.raises(MediaError, match="at most 64"):
        MediaConnector(max_bytes=64).fetch_image(server.url("/big.png"))


def test_http_404_is_refused(server):
    with pytest.raises(MediaError, match="HTTP 404"):
        MediaConnector().fetch_image(server.url("/missing.png"))


def test_host_outside_allowed_media_domains_is_refused_without_a_request(server):
    server.routes["/a.png"] = (200, PNG, 0.0, True)
    connector = MediaConnector(allowed_media_domains=["images.example.com"])
    with pytest.raises(MediaError, match="'127.0.0.1' is not allowed.*images.example.com"):
        connector.fetch_image(server.url("/a.png"))
    assert server.num_requests == 0


def test_host_in_allowed_media_domains_loads(server):
    server.routes["/a.png"] = (200, PNG, 0.0, True)
    connector = MediaConnector(allowed_media_domains=["127.0.0.1"])
    assert connector.fetch_image(server.url("/a.png")).size == (4, 3)


def test_redirect_to_a_host_outside_allowed_media_domains_is_refused(server):
    server.routes["/r.png"] = (302, b"http://images.example.com/a.png", 0.0, True)
    connector = MediaConnector(allowed_media_domains=["127.0.0.1"])
    with pytest.raises(MediaError, match="'images.example.com' is not allowed"):
        connector.fetch_image(server.url("/r.png"))


def test_slow_server_times_out(server):
    server.routes["/slow.png"] = (200, PNG, 1.5, True)
    with pytest.raises(MediaError, match="timed out"):
        MediaConnector(fetch_timeout=0.5).fetch_image(server.url("/slow.png"))


def test_a_server_that_trickles_bytes_is_cut_off_at_the_timeout(server):
    server.routes["/trickle.png"] = (200, PNG, -0.05, True)  # len(PNG) x 50 ms
    start = time.monotonic()
    with pytest.raises(MediaError, match="timed out"):
        MediaConnector(fetch_timeout=0.5).fetch_image(server.url("/trickle.png"))
    assert time.monotonic() - start < min(2.0, len(PNG) * 0.05 / 2)


def test_fetch_timeout_and_max_bytes_are_read_from_the_environment(monkeypatch):
    monkeypatch.setenv("JVLLM_IMAGE_FETCH_TIMEOUT", "2.5")
    monkeypatch.setenv("JVLLM_MAX_IMAGE_BYTES", "1000")
    connector = MediaConnector()
    assert (connector.fetch_timeout, connector.max_bytes) == (2.5, 1000)
    monkeypatch.setenv("JVLLM_MAX_IMAGE_BYTES", "0")
    with pytest.raises(ValueError, match="JVLLM_MAX_IMAGE_BYTES"):
        MediaConnector()


@pytest.mark.parametrize("url", ["ftp://example.com/a.png", "/tmp/a.png", ""])
def test_other_url_forms_are_refused_naming_the_allowed_ones(url):
    with pytest.raises(MediaError, match="allowed: data:image"):
        MediaConnector().fetch_image(url)
