"""Start-up checks shared by every process that loads models (``server.run`` for one process, the
engine process of ``--frontend-workers``): the backend and device can run here, every model
loads, and any failure is one :class:`StartupError` line for the user (the traceback is logged at
debug level)."""

from __future__ import annotations

import contextlib
import logging

import torch

from export.errors import ExportError
from export.tensorrt import import_tensorrt
from softmoe_models.convert import ConversionError
from softmoe_models.package import PackageError

from server.backends.cuda import DeviceUnavailableError, ort_cuda_preflight
from server.engine.defaults import default_packages
from server.engine.models import ServedModel, check_jpeg_draft, load_served_model
from server.engine.repository import Repository
from server.errors import ModelLoadError, NotFound
from server.pipeline.gpu_decode import GpuDecodeUnavailable, open_decoder
from server.settings import Settings

log = logging.getLogger("softmoe.server")

# Exceptions whose message is already written for the user; others are prefixed with their type.
_PLAIN = (ModelLoadError, PackageError, ConversionError, ExportError)


class StartupError(Exception):
    """The server cannot start: a setting, a model, the backend, the device or the port."""


def describe(error: BaseException) -> str:
    """A one-line description of an exception for the ``error: ...`` line."""
    if isinstance(error, _PLAIN):
        text = str(error)
    else:
        text = f"{type(error).__name__}: {error}" if str(error) else type(error).__name__
    return "; ".join(line.strip() for line in text.splitlines() if line.strip())


def check_backend(settings: Settings) -> None:
    """Fail fast, before any export or load, when the backend or the device cannot run here.

    Raises:
        StartupError: naming what is missing (the extra to install, or the device).
    """
    if settings.backend == "onnxruntime":
        try:  # an optional extra: whether it is installed is the check
            import onnxruntime as ort
        except ImportError:
            hint = "softmoe-serve[gpu]" if settings.device == "cuda" else "softmoe-serve[cpu]"
            raise StartupError(f"--backend onnxruntime needs onnxruntime: pip install '{hint}'") from None
        if settings.device == "cuda":  # the CUDA EP compiled in, and a probe session really on it
            try:
                ort_cuda_preflight(ort)
            except DeviceUnavailableError as e:
                raise StartupError(str(e)) from None
    elif settings.backend == "tensorrt":
        try:
            import_tensorrt()
        except Exception as e:  # MissingExtraError names the extra
            raise StartupError(f"--backend tensorrt: {describe(e)}") from None
    if settings.decode_device == "cuda":
        try:
            open_decoder()
        except GpuDecodeUnavailable as e:
            raise StartupError(str(e)) from None
    if settings.backend == "tensorrt" or (settings.backend == "torch" and settings.device == "cuda"):
        if not torch.cuda.is_available():
            raise StartupError(
                f"--backend {settings.backend} needs a CUDA device, and torch {torch.__version__} sees none "
                f"({'a CPU-only build' if torch.version.cuda is None else f'built for CUDA {torch.version.cuda}'})"
            )


def model_specs(settings: Settings) -> list[str]:
    """The models to load at start: ``--model``'s, then the repository's (modes none and poll: every
    one; explicit: the ``--load-model`` names, ``*`` for all); the built-in defaults when there is
    neither a ``--model`` nor a repository.

    Raises:
        StartupError: the repository is not a folder, or a ``--load-model`` name is not in it.
    """
    specs = list(settings.models)
    if not settings.model_repository:
        return specs or default_packages(settings.cache_dir)
    repo = Repository(settings.model_repository)
    if not repo.root.is_dir():
        raise StartupError(f"--model-repository {repo.root}: not a folder")
    names = repo.names()
    if settings.model_control_mode == "explicit" and "*" not in settings.load_model:
        names = list(dict.fromkeys(settings.load_model))
    for name in names:
        try:
            specs.append(f"{name}={repo.path(name)}")
        except NotFound as e:
            raise StartupError(f"--load-model {name}: {e.message}") from None
    return specs


def load_models(settings: Settings) -> list[ServedModel]:
    """Every configured model (``model_specs``), loaded; closes them all on failure.

    Raises:
        StartupError: naming the model spec and what went wrong.
    """
    try:
        specs = model_specs(settings)
    except StartupError:
        raise
    except Exception as e:
        log.debug("default models", exc_info=True)
        raise StartupError(f"default models: {describe(e)}") from None
    loaded: list[ServedModel] = []
    try:
        for spec in specs:
            try:
                loaded.append(load_served_model(spec, settings, log.info))
            except Exception as e:
                log.debug("loading %s failed", spec, exc_info=True)
                text = describe(e)
                raise StartupError(text if isinstance(e, ModelLoadError) else f"cannot load model {spec}: {text}") from None
        names = [m.name for m in loaded]
        dupes = sorted({n for n in names if names.count(n) > 1})
        if dupes:
            raise StartupError(f"two models share the name {', '.join(dupes)}; name them with --model NAME=PKG")
        try:
            check_jpeg_draft(loaded, settings.jpeg_draft)  # each model took it as it was opened
        except ModelLoadError as e:
            raise StartupError(str(e)) from None
    except BaseException:
        for m in loaded:
            with contextlib.suppress(Exception):
                m.backend.close()
        raise
    return loaded
