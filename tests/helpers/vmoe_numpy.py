"""An independent float64 numpy forward pass of vmoe models, written from vmoe-reference.md.

It reads flax-layout parameters directly (no PyTorch, no shared code with softmoe_models), so
it checks our layout mapping and config inference as well as the math. It also generates
random flax-layout parameter trees for configurations not in the golden data.
"""

from __future__ import annotations

import numpy as np


def layer_norm(x, scale, bias=None, eps=1e-6):
    mu = x.mean(-1, keepdims=True)
    var = ((x - mu) ** 2).mean(-1, keepdims=True)
    y = (x - mu) / np.sqrt(var + eps) * scale
    return y + bias if bias is not None else y


def gelu_tanh(x):
    return 0.5 * x * (1.0 + np.tanh(np.sqrt(2.0 / np.pi) * (x + 0.044715 * x**3)))


def softmax(x, axis):
    x = x - x.max(axis=axis, keepdims=True)
    e = np.exp(x)
    return e / e.sum(axis=axis, keepdims=True)


def attention(p, x, kv):
    q = np.einsum("bld,dhk->blhk", x, p["query/kernel"]) + p["query/bias"]
    k = np.einsum("bld,dhk->blhk", kv, p["key/kernel"]) + p["key/bias"]
    v = np.einsum("bld,dhk->blhk", kv, p["value/kernel"]) + p["value/bias"]
    if "query_ln/scale" in p:
        q = layer_norm(q, p["query_ln/scale"])
        k = layer_norm(k, p["key_ln/scale"])
    q = q / np.sqrt(q.shape[-1])
    w = softmax(np.einsum("bqhk,bvhk->bhqv", q, k), axis=-1)
    o = np.einsum("bhqv,bvhk->bqhk", w, v)
    return np.einsum("bqhk,hkd->bqd", o, p["out/kernel"]) + p["out/bias"]


def mlp(p, x):
    h = gelu_tanh(x @ p["Dense_0/kernel"] + p["Dense_0/bias"])
    return h @ p["Dense_1/kernel"] + p["Dense_1/bias"]


def soft_moe(p, x):
    """x (B, m, d); one group per sequence."""
    mu, scale = p["Router/mu"], p["Router/scale"]
    xn = x / np.sqrt((x**2).sum(-1, keepdims=True) + 1e-6)
    mn = mu / np.sqrt((mu**2).sum(0, keepdims=True) + 1e-6)
    logits = scale * np.einsum("bmd,dnp->bmnp", xn, mn)
    b, m, n, s = logits.shape
    dispatch = softmax(logits, axis=1)
    combine = softmax(logits.reshape(b, m, n * s), axis=-1).reshape(logits.shape)
    xs = np.einsum("bmnp,bmd->bnpd", dispatch, x)
    h = gelu_tanh(np.einsum("bnpd,ndh->bnph", xs, p["Mlp/Dense_0/kernel"]) + p["Mlp/Dense_0/bias"][:, None])
    ys = np.einsum("bnph,nhd->bnpd", h, p["Mlp/Dense_1/kernel"]) + p["Mlp/Dense_1/bias"][:, None]
    return np.einsum("bmnp,bnpd->bmd", combine, ys)


def sub(params, prefix):
    prefix = prefix + "/"
    return {k[len(prefix):]: v for k, v in params.items() if k.startswith(prefix)}


def encoder(params, x):
    x = x + params["posembed_input/pos_embedding"]
    i = 0
    while f"encoderblock_{i}/LayerNorm_0/scale" in params:
        blk = sub(params, f"encoderblock_{i}")
        y = layer_norm(x, blk["LayerNorm_0/scale"], blk["LayerNorm_0/bias"])
        x = x + attention(sub(blk, "SelfAttention"), y, y)
        y = layer_norm(x, blk["LayerNorm_1/scale"], blk["LayerNorm_1/bias"])
        x = x + (soft_moe(sub(blk, "Moe"), y) if "Moe/Router/mu" in blk else mlp(sub(blk, "Mlp"), y))
        i += 1
    return layer_norm(x, params["encoder_norm/scale"], params["encoder_norm/bias"])


def vit(params, images_nhwc):
    """Classifier logits, or pooled features when there is no head."""
    params = {k: np.asarray(v, np.float64) for k, v in params.items()}
    kernel = params["embedding/kernel"]
    ps = kernel.shape[0]
    b, h, w, c = images_nhwc.shape
    patches = images_nhwc.reshape(b, h // ps, ps, w // ps, ps, c).transpose(0, 1, 3, 2, 4, 5)
    x = patches.reshape(b, -1, ps * ps * c) @ kernel.reshape(ps * ps * c, -1) + params["embedding/bias"]
    if "cls" in params:
        x = np.concatenate([np.broadcast_to(params["cls"], (b, 1, x.shape[-1])), x], axis=1)
    x = encoder(sub(params, "Encoder"), x)
    if "cls" in params:
        pooled = x[:, 0]
    elif "MapHead/probe" in params:
        mh = sub(params, "MapHead")
        probe = np.broadcast_to(mh["probe"], (b, 1, x.shape[-1]))
        a = attention(sub(mh, "MultiHeadDotProductAttention"), probe, x)
        pooled = (a + mlp(sub(mh, "Mlp"), layer_norm(a, mh["LayerNorm/scale"], mh["LayerNorm/bias"])))[:, 0]
    else:
        pooled = x.mean(axis=1)
    if "pre_logits/kernel" in params:
        pooled = np.tanh(pooled @ params["pre_logits/kernel"] + params["pre_logits/bias"])
    if "head/kernel" in params:
        return pooled @ params["head/kernel"] + params["head/bias"]
    return pooled


def text(params, ids):
    params = {k: np.asarray(v, np.float64) for k, v in params.items()}
    x = encoder(sub(params, "Encoder"), params["Embed_0/embedding"][ids])[:, -1]
    return x @ params["head/kernel"] + params["head/bias"] if "head/kernel" in params else x


# ------------------------------------------------------------------ random flax-layout trees


def _encoder_params(rng, prefix, d, heads, mlp_dim, layers, moe_layers, n, p, tokens, qk_norm):
    dh = d // heads
    out = {f"{prefix}/posembed_input/pos_embedding": rng.normal(0, 0.02, (1, tokens, d))}
    for i in range(layers):
        b = f"{prefix}/encoderblock_{i}"
        for ln in ("LayerNorm_0", "LayerNorm_1"):
            out[f"{b}/{ln}/scale"] = 1 + rng.normal(0, 0.1, d)
            out[f"{b}/{ln}/bias"] = rng.normal(0, 0.1, d)
        for name in ("query", "key", "value"):
            out[f"{b}/SelfAttention/{name}/kernel"] = rng.normal(0, d**-0.5, (d, heads, dh))
            out[f"{b}/SelfAttention/{name}/bias"] = rng.normal(0, 0.1, (heads, dh))
        out[f"{b}/SelfAttention/out/kernel"] = rng.normal(0, d**-0.5, (heads, dh, d))
        out[f"{b}/SelfAttention/out/bias"] = rng.normal(0, 0.1, d)
        if qk_norm:
            out[f"{b}/SelfAttention/query_ln/scale"] = 1 + rng.normal(0, 0.1, dh)
            out[f"{b}/SelfAttention/key_ln/scale"] = 1 + rng.normal(0, 0.1, dh)
        if i in moe_layers:
            out[f"{b}/Moe/Router/mu"] = rng.normal(0, d**-0.5, (d, n, p)) * rng.uniform(0.5, 2, (1, n, p))
            out[f"{b}/Moe/Router/scale"] = np.array(rng.uniform(4, 12))
            out[f"{b}/Moe/Mlp/Dense_0/kernel"] = rng.normal(0, d**-0.5, (n, d, mlp_dim))
            out[f"{b}/Moe/Mlp/Dense_0/bias"] = rng.normal(0, 0.1, (n, mlp_dim))
            out[f"{b}/Moe/Mlp/Dense_1/kernel"] = rng.normal(0, mlp_dim**-0.5, (n, mlp_dim, d))
            out[f"{b}/Moe/Mlp/Dense_1/bias"] = rng.normal(0, 0.1, (n, d))
        else:
            out[f"{b}/Mlp/Dense_0/kernel"] = rng.normal(0, d**-0.5, (d, mlp_dim))
            out[f"{b}/Mlp/Dense_0/bias"] = rng.normal(0, 0.1, mlp_dim)
            out[f"{b}/Mlp/Dense_1/kernel"] = rng.normal(0, mlp_dim**-0.5, (mlp_dim, d))
            out[f"{b}/Mlp/Dense_1/bias"] = rng.normal(0, 0.1, d)
    out[f"{prefix}/encoder_norm/scale"] = 1 + rng.normal(0, 0.1, d)
    out[f"{prefix}/encoder_norm/bias"] = rng.normal(0, 0.1, d)
    return out


def random_vit_params(
    seed=0, d=32, heads=2, mlp_dim=48, layers=2, moe_layers=(1,), n=4, p=1, patch=4, image_size=16,
    num_classes=7, classifier="gap", representation_size=None, qk_norm=True, prefix="",
):
    """A vmoe VisionTransformerMoe parameter tree (float32), flax layout."""
    rng = np.random.default_rng(seed)
    f = (prefix + "/") if prefix else ""
    tokens = (image_size // patch) ** 2 + (1 if classifier == "token" else 0)
    out = {
        f"{f}embedding/kernel": rng.normal(0, 0.1, (patch, patch, 3, d)),
        f"{f}embedding/bias": rng.normal(0, 0.1, d),
    }
    if classifier == "token":
        out[f"{f}cls"] = rng.normal(0, 0.1, (1, 1, d))
    out.update(_encoder_params(rng, f"{f}Encoder", d, heads, mlp_dim, layers, set(moe_layers), n, p, tokens, qk_norm))
    if classifier == "map":
        dh = d // heads
        out[f"{f}MapHead/probe"] = rng.normal(0, 0.1, (1, 1, d))
        m = f"{f}MapHead/MultiHeadDotProductAttention"
        for name in ("query", "key", "value"):
            out[f"{m}/{name}/kernel"] = rng.normal(0, d**-0.5, (d, heads, dh))
            out[f"{m}/{name}/bias"] = rng.normal(0, 0.1, (heads, dh))
        out[f"{m}/out/kernel"] = rng.normal(0, d**-0.5, (heads, dh, d))
        out[f"{m}/out/bias"] = rng.normal(0, 0.1, d)
        if qk_norm:
            out[f"{m}/query_ln/scale"] = 1 + rng.normal(0, 0.1, dh)
            out[f"{m}/key_ln/scale"] = 1 + rng.normal(0, 0.1, dh)
        out[f"{f}MapHead/LayerNorm/scale"] = 1 + rng.normal(0, 0.1, d)
        out[f"{f}MapHead/LayerNorm/bias"] = rng.normal(0, 0.1, d)
        out[f"{f}MapHead/Mlp/Dense_0/kernel"] = rng.normal(0, d**-0.5, (d, mlp_dim))
        out[f"{f}MapHead/Mlp/Dense_0/bias"] = rng.normal(0, 0.1, mlp_dim)
        out[f"{f}MapHead/Mlp/Dense_1/kernel"] = rng.normal(0, mlp_dim**-0.5, (mlp_dim, d))
        out[f"{f}MapHead/Mlp/Dense_1/bias"] = rng.normal(0, 0.1, d)
    feat = d
    if representation_size:
        out[f"{f}pre_logits/kernel"] = rng.normal(0, d**-0.5, (d, representation_size))
        out[f"{f}pre_logits/bias"] = rng.normal(0, 0.1, representation_size)
        feat = representation_size
    if num_classes:
        out[f"{f}head/kernel"] = rng.normal(0, feat**-0.5, (feat, num_classes))
        out[f"{f}head/bias"] = rng.normal(0, 0.1, num_classes)
    return {k: np.asarray(v, np.float32) for k, v in out.items()}


def random_two_tower_params(seed=0, d=32, text_d=24, vocab=50, max_len=8, text_layers=2, **image_kw):
    rng = np.random.default_rng(seed + 1000)
    out = random_vit_params(seed=seed, d=d, num_classes=None, prefix="img", **image_kw)
    out["txt/Embed_0/embedding"] = rng.normal(0, 1, (vocab, text_d))
    out.update(_encoder_params(rng, "txt/Encoder", text_d, 2, 2 * text_d, text_layers, set(), 0, 0, max_len, True))
    out["txt/head/kernel"] = rng.normal(0, text_d**-0.5, (text_d, d))
    out["txt/head/bias"] = rng.normal(0, 0.1, d)
    out["s"] = np.array(np.log(10.0) + 0.2)
    out["b"] = np.array(-8.5)
    return {k: np.asarray(v, np.float32) for k, v in out.items()}
