"""The official clients against a real server on loopback: Triton's ``tritonclient.http`` (Open
Inference Protocol v2, JSON and binary tensors) and the ``openai`` SDK (``/v1/embeddings``).

The served models are the golden vmoe checkpoints converted by the real converter; outputs are
checked against the vmoe (JAX) reference outputs stored with them.
"""

from __future__ import annotations

import base64
import io
import socket
import threading
import time

import httpx
import numpy as np
import pytest
import uvicorn
from PIL import Image

from conftest import GOLDEN, golden_npz
from softmoe_models.preprocess import PreprocessConfig, to_pixel_values

from server.http.app import create_app
from server.settings import Settings

ATOL = 1e-4
START_TIMEOUT = 180.0  # only to turn a failed start into an error, never asserted


@pytest.fixture(scope="module")
def server(tmp_path_factory, golden_dir):
    """A uvicorn server on 127.0.0.1 (a pre-bound free port) serving ``golden`` and ``tt``."""
    from softmoe_models.convert import convert_checkpoint

    root = tmp_path_factory.mktemp("client-models")
    golden, _ = convert_checkpoint(GOLDEN / "softmoe_e8p1.npz", root / "golden")
    tt, _ = convert_checkpoint(GOLDEN / "twotower.npz", root / "tt", text_pool="last")

    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    settings = Settings(models=[f"golden={golden}", f"tt={tt}"], max_batch_size=4, port=port)
    srv = uvicorn.Server(uvicorn.Config(create_app(settings), host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=srv.run, kwargs={"sockets": [sock]}, name="uvicorn-test", daemon=True)
    thread.start()
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + START_TIMEOUT
    try:
        with httpx.Client(trust_env=False, timeout=5) as http:
            while True:
                try:
                    if http.get(f"{base}/v2/health/ready").status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                if not thread.is_alive():
                    raise RuntimeError("the server exited during startup (see the log above)")
                if time.monotonic() > deadline:
                    raise RuntimeError("the server did not become ready")
                time.sleep(0.05)
        yield {"port": port, "base": base, "settings": settings}
    finally:
        srv.should_exit = True
        thread.join(60)
        sock.close()
        assert not thread.is_alive(), "the server thread did not stop"


@pytest.fixture(scope="module")
def triton(server):
    import tritonclient.http as httpclient

    client = httpclient.InferenceServerClient(url=f"127.0.0.1:{server['port']}", network_timeout=60.0)
    yield client
    client.close()


@pytest.fixture(scope="module")
def oai(server):
    import openai

    client = openai.OpenAI(base_url=f"{server['base']}/v1", api_key="unused", max_retries=0, timeout=60.0,
                           http_client=openai.DefaultHttpxClient(trust_env=False))
    yield client
    client.close()


def nchw(images_nhwc: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(images_nhwc.transpose(0, 3, 1, 2), dtype=np.float32)


def to_uint8(images: np.ndarray) -> np.ndarray:
    """[-1, 1] float images -> uint8, as an image file would carry them."""
    return np.clip(np.round((images + 1) / 2 * 255), 0, 255).astype(np.uint8)


def png_data_uri(rgb_u8: np.ndarray) -> str:
    buf = io.BytesIO()
    Image.fromarray(rgb_u8, "RGB").save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def pixels_of(rgb_u8: np.ndarray) -> np.ndarray:
    """The pixel values the server computes from that PNG (32x32: no resize), NCHW with batch axis."""
    return to_pixel_values(rgb_u8, PreprocessConfig(image_size=32))[None]


# ------------------------------------------------------------------------------ tritonclient


def test_triton_health_and_metadata(triton):
    assert triton.is_server_live()
    assert triton.is_server_ready()
    assert triton.is_model_ready("golden")
    assert triton.is_model_ready("tt")
    assert not triton.is_model_ready("no-such-model")

    meta = triton.get_model_metadata("golden")
    assert meta["name"] == "golden"
    inputs = {t["name"]: t for t in meta["inputs"]}
    outputs = {t["name"]: t for t in meta["outputs"]}
    assert "pixel_values" in inputs and "logits" in outputs
    assert inputs["pixel_values"]["datatype"] == "FP32"
    assert inputs["pixel_values"]["shape"] == [-1, 3, 32, 32]

    tt = triton.get_model_metadata("tt")
    assert {t["name"] for t in tt["inputs"]} == {"pixel_values", "input_ids"}
    assert {t["name"] for t in tt["outputs"]} >= {"image_embeds", "text_embeds"}

    server_meta = triton.get_server_metadata()
    assert "binary_tensor_data" in server_meta["extensions"]


@pytest.mark.parametrize("binary", [True, False], ids=["binary", "json"])
def test_triton_classifier_logits_match_golden(triton, binary):
    import tritonclient.http as httpclient

    g = golden_npz("softmoe_e8p1")
    x = nchw(g["inputs/images"])
    inp = httpclient.InferInput("pixel_values", list(x.shape), "FP32")
    inp.set_data_from_numpy(x, binary_data=binary)
    out = httpclient.InferRequestedOutput("logits", binary_data=binary)
    res = triton.infer("golden", [inp], outputs=[out], request_id="req-1")
    logits = res.as_numpy("logits")
    assert logits.shape == (4, 10) and logits.dtype == np.float32
    np.testing.assert_allclose(logits, g["outputs_fp32dispatch/logits"], atol=ATOL, rtol=0)
    response = res.get_response()
    assert response["model_name"] == "golden"
    assert response["id"] == "req-1"
    assert [o["name"] for o in response["outputs"]] == ["logits"]  # only what was asked for


def test_triton_classifier_all_outputs_by_default(triton):
    import tritonclient.http as httpclient

    g = golden_npz("softmoe_e8p1")
    x = nchw(g["inputs/images"][:2])
    inp = httpclient.InferInput("pixel_values", list(x.shape), "FP32")
    inp.set_data_from_numpy(x, binary_data=True)
    res = triton.infer("golden", [inp])
    np.testing.assert_allclose(res.as_numpy("logits"), g["outputs_fp32dispatch/logits"][:2], atol=ATOL, rtol=0)
    np.testing.assert_allclose(res.as_numpy("pre_logits"), g["outputs_fp32dispatch/pre_logits"][:2], atol=ATOL, rtol=0)


@pytest.mark.parametrize("dtype", ["INT64", "INT32"])
@pytest.mark.parametrize("binary", [True, False], ids=["binary", "json"])
def test_triton_two_tower_text_embeds_match_golden(triton, dtype, binary):
    import tritonclient.http as httpclient

    g = golden_npz("twotower")
    ids = g["inputs/texts"].astype(np.int64 if dtype == "INT64" else np.int32)  # 5 rows: two batches of 4
    inp = httpclient.InferInput("input_ids", list(ids.shape), dtype)
    inp.set_data_from_numpy(ids, binary_data=binary)
    res = triton.infer("tt", [inp], outputs=[httpclient.InferRequestedOutput("text_embeds", binary_data=binary)])
    z = res.as_numpy("text_embeds")
    assert z.shape == (5, 64)
    np.testing.assert_allclose(z, g["outputs_fp32dispatch/ztxt"], atol=ATOL, rtol=0)
    np.testing.assert_allclose(np.linalg.norm(z, axis=1), 1.0, atol=1e-5)


def test_triton_two_tower_image_embeds_match_golden(triton):
    import tritonclient.http as httpclient

    g = golden_npz("twotower")
    x = nchw(g["inputs/images"])
    inp = httpclient.InferInput("pixel_values", list(x.shape), "FP32")
    inp.set_data_from_numpy(x, binary_data=True)
    res = triton.infer("tt", [inp], outputs=[httpclient.InferRequestedOutput("image_embeds", binary_data=True)])
    z = res.as_numpy("image_embeds")
    assert z.shape == (4, 64)
    np.testing.assert_allclose(z, g["outputs_fp32dispatch/zimg"], atol=ATOL, rtol=0)


def test_triton_two_tower_both_towers_in_one_request(triton):
    import tritonclient.http as httpclient

    g = golden_npz("twotower")
    x = nchw(g["inputs/images"])
    ids = g["inputs/texts"].astype(np.int64)
    pix = httpclient.InferInput("pixel_values", list(x.shape), "FP32")
    pix.set_data_from_numpy(x, binary_data=True)
    txt = httpclient.InferInput("input_ids", list(ids.shape), "INT64")
    txt.set_data_from_numpy(ids, binary_data=False)  # one binary, one JSON tensor
    res = triton.infer("tt", [pix, txt], outputs=[httpclient.InferRequestedOutput("image_embeds", binary_data=True),
                                                   httpclient.InferRequestedOutput("text_embeds", binary_data=False)])
    zimg, ztxt = res.as_numpy("image_embeds"), res.as_numpy("text_embeds")
    np.testing.assert_allclose(zimg, g["outputs_fp32dispatch/zimg"], atol=ATOL, rtol=0)
    np.testing.assert_allclose(ztxt, g["outputs_fp32dispatch/ztxt"], atol=ATOL, rtol=0)
    # vmoe's two-tower logits follow from the two embeddings and the learned scale and bias
    logits = np.exp(g["params/s"]) * (zimg @ ztxt.T) + g["params/b"]
    np.testing.assert_allclose(logits, g["outputs_fp32dispatch/logits"], atol=3e-3, rtol=0)


def test_triton_unknown_model_raises(triton):
    import tritonclient.http as httpclient
    from tritonclient.utils import InferenceServerException

    x = np.zeros((1, 3, 32, 32), np.float32)
    inp = httpclient.InferInput("pixel_values", list(x.shape), "FP32")
    inp.set_data_from_numpy(x, binary_data=True)
    with pytest.raises(InferenceServerException) as info:
        triton.infer("no-such-model", [inp])
    assert info.value.status() == "404"
    assert "not served" in str(info.value)  # OIP error body {"error": "<message>"}: the client can read it
    with pytest.raises(InferenceServerException):
        triton.get_model_metadata("no-such-model")
    assert not triton.is_model_ready("golden", model_version="7")


def test_triton_classification_extension(triton):
    import tritonclient.http as httpclient

    data = golden_npz("softmoe_e8p1")
    x = nchw(data["inputs/images"])
    inp = httpclient.InferInput("pixel_values", list(x.shape), "FP32")
    inp.set_data_from_numpy(x, binary_data=True)
    out = httpclient.InferRequestedOutput("logits", binary_data=True, class_count=3)
    top = triton.infer("golden", [inp], outputs=[out]).as_numpy("logits")
    assert top.shape == (4, 3)
    first = [int(entry.decode().split(":")[1]) for entry in top[:, 0]]
    assert first == data["outputs_fp32dispatch/logits"].argmax(-1).tolist()


def test_triton_bad_input_raises(triton):
    import tritonclient.http as httpclient
    from tritonclient.utils import InferenceServerException

    x = np.zeros((1, 3, 16, 16), np.float32)  # the model takes 32x32
    inp = httpclient.InferInput("pixel_values", list(x.shape), "FP32")
    inp.set_data_from_numpy(x, binary_data=True)
    with pytest.raises(InferenceServerException) as info:
        triton.infer("golden", [inp])
    assert info.value.status() == "400"


# ------------------------------------------------------------------------------ openai SDK


def _oip_row(triton, model: str, x: np.ndarray, output: str) -> np.ndarray:
    import tritonclient.http as httpclient

    inp = httpclient.InferInput("pixel_values", list(x.shape), "FP32")
    inp.set_data_from_numpy(x, binary_data=True)
    return triton.infer(model, [inp], outputs=[httpclient.InferRequestedOutput(output, binary_data=True)]).as_numpy(output)[0]


def test_openai_two_tower_image_embedding(oai, triton):
    u8 = to_uint8(golden_npz("twotower")["inputs/images"][0])
    res = oai.embeddings.create(model="tt", input=[png_data_uri(u8)])
    assert res.model == "tt"
    assert len(res.data) == 1 and res.data[0].index == 0
    v = np.asarray(res.data[0].embedding, dtype=np.float32)  # the SDK asked for base64 and decoded it
    assert v.shape == (64,)
    assert np.linalg.norm(v) == pytest.approx(1.0, abs=1e-4)
    # the same pixels through OIP give the same embedding
    np.testing.assert_allclose(v, _oip_row(triton, "tt", pixels_of(u8), "image_embeds"), atol=1e-5, rtol=0)


def test_openai_encoding_formats(oai):
    uri = png_data_uri(to_uint8(golden_npz("twotower")["inputs/images"][1]))
    b64 = oai.embeddings.create(model="tt", input=[uri], encoding_format="base64")
    raw = b64.data[0].embedding
    assert isinstance(raw, str)  # asked for explicitly: the SDK leaves it as sent
    v64 = np.frombuffer(base64.b64decode(raw), dtype="<f4")
    assert v64.shape == (64,)
    flt = oai.embeddings.create(model="tt", input=uri, encoding_format="float")
    vf = np.asarray(flt.data[0].embedding, dtype=np.float32)
    assert vf.shape == (64,)
    np.testing.assert_array_equal(v64, vf)
    assert np.linalg.norm(vf) == pytest.approx(1.0, abs=1e-4)


def test_openai_several_images_keep_their_order(oai, triton):
    u8 = to_uint8(golden_npz("twotower")["inputs/images"])
    res = oai.embeddings.create(model="tt", input=[png_data_uri(im) for im in u8[::-1]])
    assert [d.index for d in res.data] == [0, 1, 2, 3]
    for d, im in zip(res.data, u8[::-1]):
        np.testing.assert_allclose(np.asarray(d.embedding, np.float32), _oip_row(triton, "tt", pixels_of(im), "image_embeds"),
                                   atol=1e-5, rtol=0)


def test_openai_classifier_embeds_pooled_features(oai, triton):
    u8 = golden_npz("softmoe_e8p1")["inputs/images_uint8"][0]
    res = oai.embeddings.create(model="golden", input=[png_data_uri(u8)])
    v = np.asarray(res.data[0].embedding, dtype=np.float32)
    assert v.shape == (64,)
    assert np.linalg.norm(v) == pytest.approx(1.0, abs=1e-4)
    pre = _oip_row(triton, "golden", pixels_of(u8), "pre_logits")
    np.testing.assert_allclose(v, pre / np.linalg.norm(pre), atol=1e-5, rtol=0)


def test_openai_unknown_model_is_not_found(oai):
    import openai

    uri = png_data_uri(to_uint8(golden_npz("twotower")["inputs/images"][0]))
    with pytest.raises(openai.NotFoundError) as info:
        oai.embeddings.create(model="no-such-model", input=[uri])
    assert info.value.status_code == 404
    assert "no-such-model" in str(info.value)


def test_openai_text_without_tokenizer_is_422(oai):
    import openai

    with pytest.raises(openai.UnprocessableEntityError) as info:
        oai.embeddings.create(model="tt", input=["a photo of a cat"])
    assert info.value.status_code == 422
    assert "tokenizer" in str(info.value)


def test_openai_text_on_classifier_is_422(oai):
    import openai

    with pytest.raises(openai.UnprocessableEntityError) as info:
        oai.embeddings.create(model="golden", input="a photo of a cat")
    assert info.value.status_code == 422
