"""Request and response bodies (pydantic), shared by the routes and the OpenAPI document."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationError
from pydantic_core import PydanticCustomError

from server.errors import BadRequest, Unprocessable

UNICODE_ERROR = "unicode"  # the validation error type of Text: a 400 naming the field (routes.inputs)
# Validation error types of text that is not Unicode: Text's, and pydantic's own for a constrained str.
NOT_UNICODE = (UNICODE_ERROR, "string_unicode")


def _unicode(value: str) -> str:
    """JSON's ``\\uXXXX`` escapes can carry a lone surrogate (``"a\\ud800b"``), which is text to
    Python and to JSON parsers but not Unicode: no encoder, tokenizer or response takes it."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as e:
        raise PydanticCustomError(UNICODE_ERROR, "not valid Unicode: a lone surrogate ({char}) at character {at}",
                                  {"char": f"\\u{ord(value[e.start]):04x}", "at": e.start}) from None
    return value


# Every text a request carries (names, labels, templates, texts, ids) is checked as Unicode where it enters.
Text = Annotated[str, AfterValidator(_unicode)]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class ErrorDetail(BaseModel):
    message: str
    type: str
    code: int
    param: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorDetail


class OIPError(BaseModel):
    """Open Inference Protocol error body."""

    error: str


class Health(BaseModel):
    model_config = ConfigDict(extra="allow")
    live: bool | None = None
    ready: bool | None = None
    reason: str | None = None


class ModelReadiness(BaseModel):
    name: str
    ready: bool


class RepositoryEntry(BaseModel):
    name: str
    version: str = Field(description="the serving version's number (loads so far); empty if never loaded")
    state: Literal["READY", "UNAVAILABLE", "LOADING", "UNLOADING"]
    reason: str = Field("", description="why it is not READY, or why its last load failed")


class RepositoryIndexRequest(_Strict):
    ready: bool = Field(False, description="only the models ready for inference")


class RepositoryLoadParameters(_Strict):
    unload_first: bool = Field(
        False, description="unload the serving version before loading the new one (a gap in service: for a "
        "model whose two versions do not fit in memory together)")


class RepositoryLoadRequest(_Strict):
    parameters: RepositoryLoadParameters = Field(default_factory=RepositoryLoadParameters)


class RepositoryUnloadParameters(_Strict):
    unload_dependents: bool = Field(False, description="Triton's; models here have no dependents")


class RepositoryUnloadRequest(_Strict):
    parameters: RepositoryUnloadParameters = Field(default_factory=RepositoryUnloadParameters)


class ClassifyRequest(_Strict):
    model: Text | None = Field(None, max_length=256, description="served model name; default: the first classifier")
    images: list[str] = Field(..., min_length=1, description="base64 strings or data:image/...;base64, URIs")
    top_k: int = Field(5, ge=1, le=1000, description="labels returned per image")


class Prediction(BaseModel):
    label: str
    index: int
    score: float


class ClassifyResult(BaseModel):
    predictions: list[Prediction]


class ClassifyResponse(BaseModel):
    model: str
    results: list[ClassifyResult]


class EmbedRequest(_Strict):
    model: Text | None = Field(None, max_length=256, description="served model name; default: the first model that can embed")
    images: list[str] | None = Field(None, description="base64 strings or data URIs")
    texts: list[Text] | None = Field(None, description="texts (two-tower models with a tokenizer)")
    normalize: bool = Field(True, description="L2-normalise (two-tower embeddings are always normalised)")


class EmbedResponse(BaseModel):
    model: str
    image_embeddings: list[list[float]] | None = None
    text_embeddings: list[list[float]] | None = None


class ZeroShotRequest(_Strict):
    model: Text | None = Field(None, max_length=256, description="served two-tower model; default: the first one")
    images: list[str] = Field(..., min_length=1)
    labels: list[Text] = Field(..., min_length=1, description="candidate labels")
    templates: list[Text] | None = Field(None, description="prompt templates with one '{}' each; default: the model's")
    activation: Literal["sigmoid", "softmax"] = Field("sigmoid", description="sigmoid: vmoe's SigLIP match "
                                                      "probability per label; softmax: over the labels")


class LabelScore(BaseModel):
    label: str
    score: float


class ZeroShotResult(BaseModel):
    scores: list[LabelScore]


class ZeroShotResponse(BaseModel):
    model: str
    results: list[ZeroShotResult]


class EmbeddingsRequest(BaseModel):
    """OpenAI ``POST /v1/embeddings``; image inputs as ``data:image/...;base64,`` URIs."""

    model_config = ConfigDict(extra="allow")
    model: Text = Field(..., max_length=256)
    input: Text | list[Text] = Field(..., description="texts and/or image data URIs")
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = None
    user: Text | None = None


class EmbeddingData(BaseModel):
    object: Literal["embedding"] = "embedding"
    index: int
    embedding: list[float] | str


class Usage(BaseModel):
    prompt_tokens: int
    total_tokens: int


class EmbeddingsResponse(BaseModel):
    object: Literal["list"] = "list"
    data: list[EmbeddingData]
    model: str
    usage: Usage


class OIPTensor(BaseModel):
    model_config = ConfigDict(extra="allow")
    name: Text = Field(..., max_length=256)
    shape: list[int]
    datatype: Text = Field(..., max_length=16)
    parameters: dict[str, Any] | None = None
    data: list[Any] | None = None


class OIPRequestedOutput(BaseModel):
    model_config = ConfigDict(extra="allow")
    name: Text = Field(..., max_length=256)
    parameters: dict[str, Any] | None = None


class OIPInferRequest(BaseModel):
    model_config = ConfigDict(extra="allow")
    id: Text | None = Field(None, max_length=256)
    parameters: dict[str, Any] | None = None
    inputs: list[OIPTensor]
    outputs: list[OIPRequestedOutput] | None = None


class OIPInferResponse(BaseModel):
    model_name: str
    model_version: str | None = None
    id: str | None = None
    parameters: dict[str, Any] | None = None
    outputs: list[OIPTensor]


class OIPMetadataTensor(BaseModel):
    name: str
    datatype: str
    shape: list[int]


class OIPModelMetadata(BaseModel):
    name: str
    versions: list[str]
    platform: str
    inputs: list[OIPMetadataTensor]
    outputs: list[OIPMetadataTensor]
    parameters: dict[str, Any] | None = Field(
        None, description="the backend, device, precision and (ONNX Runtime) execution providers actually in use")


class OIPServerMetadata(BaseModel):
    name: str
    version: str
    extensions: list[str]


def validation_error(e: ValidationError) -> Unprocessable | BadRequest:
    """The first error, naming its field: 422 for what the schema refuses, 400 for text that is not
    Unicode (a malformed request, like bad base64), which is reported first wherever it is."""
    errors = e.errors()
    bad_text = [err for err in errors if err.get("type") in NOT_UNICODE]
    err = (bad_text or errors)[0]
    # A union's member tags ("function-after[...]", "list[...]") are pydantic's, not the request's.
    loc = ".".join(str(p) for p in err.get("loc", ()) if not (isinstance(p, str) and "[" in p))
    message = f"{loc}: {err.get('msg')}" if loc else str(err.get("msg"))
    return (BadRequest if bad_text else Unprocessable)(message, param=loc or None)
