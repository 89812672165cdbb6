"""The device router (vkmoe.ops.router: shaders/moe_router.comp, GEMV + selection in one dispatch) against the
float64 reference and the numpy router of every family, exact ties (the lower expert index wins, as in
vkmoe.models.routing), a token whose scores are all equal, m = 1 and a larger m."""
import numpy as np
import pytest

from vkmoe.models.routing import router_logits, sigmoid_group_topk, softmax_topk, sqrtsp_hash, sqrtsp_topk
from vkmoe.ops.router import DeviceRouter, weight_words

E, H, K = 64, 256, 6


def _weights(seed, dtype=np.float16):
    rng = np.random.default_rng(seed)
    return (rng.standard_normal((E, H)) / 16).astype(dtype)


def _hidden(m, seed, dtype=np.float16):
    return np.random.default_rng(100 + seed).standard_normal((m, H)).astype(dtype)


BIAS = (np.random.default_rng(7).standard_normal(E) * 0.1).astype(np.float32)
SCALE = np.linspace(0.5, 2.0, E).astype(np.float32)

# (family, DeviceRouter keywords, numpy router of the logits)
CASES = {
    "std_norm": ("std", dict(norm=True), lambda z: softmax_topk(z, K, True)),
    "std_plain": ("std", dict(norm=False), lambda z: softmax_topk(z, K, False)),
    "std_per_expert_scale": ("std", dict(norm=True, per_expert_scale=SCALE), lambda z: softmax_topk(z, K, True, SCALE)),
    "dots_bias": ("dots", dict(bias=BIAS, norm=True, routed_scaling_factor=2.5),
                  lambda z: sigmoid_group_topk(z, BIAS, K, 1, 1, True, 2.5)),
    "dots_groups": ("dots", dict(bias=BIAS, n_group=8, topk_group=3, norm=True, routed_scaling_factor=1.5),
                    lambda z: sigmoid_group_topk(z, BIAS, K, 8, 3, True, 1.5)),
    "dots_no_norm": ("dots", dict(norm=False, routed_scaling_factor=1.0),
                     lambda z: sigmoid_group_topk(z, None, K, 1, 1, False, 1.0)),
    "sqrtsp": ("sqrtsp", dict(bias=BIAS, routed_scaling_factor=1.5), lambda z: sqrtsp_topk(z, BIAS, K, 1.5)),
}


def _route(device, family, weight, x, tokens=None, **kw):
    router = DeviceRouter(device, family, weight, K, **kw)
    try:
        return router(x, tokens)
    finally:
        router.close()


@pytest.mark.parametrize("m", [1, 37])
@pytest.mark.parametrize("case", sorted(CASES))
def test_router_matches_float64_reference(device, case, m):
    family, kw, numpy_router = CASES[case]
    w, x = _weights(m), _hidden(m, seed=len(case))
    ids, wts = _route(device, family, w, x, **kw)
    ids64, w64 = numpy_router(router_logits(x, w, np.float64))
    assert ids.dtype == np.int64 and wts.dtype == np.float32
    assert np.array_equal(ids, ids64), "no near ties in random data: ids must equal the float64 router's"
    np.testing.assert_allclose(wts, w64, rtol=2e-6, atol=1e-7)
    ids32, _ = numpy_router(router_logits(x, w, np.float32))
    assert np.array_equal(ids, ids32)


def test_router_fp32_hidden_and_bf16_weight(device):
    """bf16 router weights (widened to fp32 exactly by the checkpoint reader) go up as bf16; fp32 hidden."""
    w = _weights(3, np.float32)
    w = (w.view(np.uint32) & 0xFFFF0000).view(np.float32)  # bf16 values
    assert weight_words(w)[1] == "bfloat16"
    x = _hidden(9, seed=4, dtype=np.float32)
    ids, wts = _route(device, "std", w, x, norm=True)
    ids64, w64 = softmax_topk(router_logits(x, w, np.float64), K, True)
    assert np.array_equal(ids, ids64)
    np.testing.assert_allclose(wts, w64, rtol=2e-6, atol=1e-7)


def test_interm_div_scales_the_weights(device):
    w, x = _weights(5), _hidden(4, seed=5)
    ids, wts = _route(device, "dots", w, x, bias=BIAS, routed_scaling_factor=2.0, op_scale=128.0)
    ids64, w64 = sigmoid_group_topk(router_logits(x, w, np.float64), BIAS, K, 1, 1, True, 2.0)
    assert np.array_equal(ids, ids64)
    np.testing.assert_allclose(wts, 128.0 * w64, rtol=2e-6)


def test_hash_router_reads_the_table(device):
    rng = np.random.default_rng(11)
    V = 50
    table = np.stack([rng.permutation(E)[:K] for _ in range(V)])
    w, x = _weights(6), _hidden(13, seed=6)
    tokens = rng.integers(0, V, 13)
    ids, wts = _route(device, "sqrtsp_hash", w, x, tokens=tokens, tid2eid=table, routed_scaling_factor=1.5)
    ids64, w64 = sqrtsp_hash(router_logits(x, w, np.float64), table[tokens], 1.5)
    assert np.array_equal(ids, ids64)
    np.testing.assert_allclose(wts, w64, rtol=2e-6, atol=1e-7)


def _exact_logits(values):
    """A weight and hidden whose logits are exactly `values` (m, E) in every summation order: column 0 of x is
    1, W[:, 0] the values (small integers / 4), everything else 0."""
    values = np.asarray(values, np.float64)
    w = np.zeros((values.shape[1], H), np.float16)
    x = np.zeros((values.shape[0], H), np.float16)
    x[:, 0] = 1.0
    assert values.shape[0] == 1
    w[:, 0] = values[0]
    return w, x


TIE_FAMILIES = {
    "std": (dict(norm=True), lambda z: softmax_topk(z, K, True)),
    "dots": (dict(norm=True, routed_scaling_factor=1.0), lambda z: sigmoid_group_topk(z, None, K, 1, 1, True, 1.0)),
    "sqrtsp": (dict(routed_scaling_factor=1.0), lambda z: sqrtsp_topk(z, None, K, 1.0)),
}


@pytest.mark.parametrize("family", sorted(TIE_FAMILIES))
def test_exact_ties_pick_the_lower_index(device, family):
    kw, numpy_router = TIE_FAMILIES[family]
    vals = np.zeros((1, E))
    vals[0, [3, 9, 17, 40, 41, 63]] = 2.0       # six tied at the top ...
    vals[0, [5, 6, 50]] = 1.25                   # ... three tied next
    vals[0, [2]] = 3.0
    w, x = _exact_logits(vals)
    ids, wts = _route(device, family, w, x, **kw)
    ids_np, w_np = numpy_router(router_logits(x, w, np.float64))
    assert ids.tolist() == [[2, 3, 9, 17, 40, 41]] == ids_np.tolist()
    np.testing.assert_allclose(wts, w_np, rtol=2e-6)
    assert wts[0, 1] == wts[0, 5]  # tied experts get bit-equal weights


@pytest.mark.parametrize("family", sorted(TIE_FAMILIES))
def test_token_with_all_scores_equal(device, family):
    kw, numpy_router = TIE_FAMILIES[family]
    w, x = _weights(8), np.zeros((3, H), np.float16)  # every logit 0
    ids, wts = _route(device, family, w, x, **kw)
    assert ids.tolist() == [list(range(K))] * 3 == numpy_router(np.zeros((3, E)))[0].tolist()
    np.testing.assert_allclose(wts, numpy_router(np.zeros((3, E)))[1], rtol=2e-6)


def test_group_ties_pick_the_lower_group(device):
    """dots, 8 groups of 8, top 3 groups: group 2 leads, groups 1, 4 and 6 tie on their top-2 sums (the same two
    scores); groups 1 and 4 stay."""
    vals = np.full((1, E), -2.0)
    for g, top in ((1, (1.0, 0.5)), (4, (0.5, 1.0)), (6, (1.0, 0.5)), (2, (2.0, 0.0))):
        vals[0, g * 8 + 2], vals[0, g * 8 + 5] = top
    w, x = _exact_logits(vals)
    z = router_logits(x, w, np.float64)
    ids_np, w_np = sigmoid_group_topk(z, None, K, 8, 3, True, 1.0)
    ids, wts = _route(device, "dots", w, x, n_group=8, topk_group=3, norm=True)
    assert np.array_equal(ids, ids_np)
    assert set(ids_np[0] // 8) == {1, 2, 4}  # group 6 lost the tie to 1 and 4
    np.testing.assert_allclose(wts, w_np, rtol=2e-6)


def _group_rows(n_experts, n_group, seed):
    """Tokens for the group-limited selection at one group width: every group's two best logits from a small set
    of pairs (so that equal pairs tie exactly in any precision, and unequal ones differ far above fp32's rounding),
    placed anywhere in the group, over a floor of low ties; pairs held by several groups (ties: the lower group),
    a group whose best value is held twice, all groups equal, and one token where every group's best sits on its
    first and last expert."""
    rng = np.random.default_rng(seed)
    per = n_experts // n_group
    pairs = [(4.0, 3.0), (3.5, 3.5), (4.0, 1.0), (2.0, 1.5), (3.0, 0.5)]
    rows = []
    for _ in range(3):
        r = rng.integers(-24, -20, n_experts) / 4
        for g in range(n_group):
            a, b = pairs[rng.integers(len(pairs))]
            at = g * per + rng.permutation(per)[:2]
            r[at[0]], r[at[1]] = a, b if per >= 2 else a
        rows.append(r)
    rows.append(np.zeros(n_experts))
    r = np.full(n_experts, -5.0)
    r[0::per], r[per - 1::per] = 2.0, rng.integers(0, 8, n_group) / 4
    rows.append(r)
    return np.stack(rows)


@pytest.mark.parametrize("n_experts,n_group", [(256, 64), (256, 32), (256, 16), (256, 8), (256, 4), (72, 9),
                                               (512, 64), (512, 16)])
def test_group_scores_at_every_group_width(device, n_experts, n_group):
    """dots over 256 experts in groups of 4 .. 64 (and 72 in groups of 8, a partial chunk of 256; 512 in groups of
    8 and 32, two chunks): the width that equals the device's subgroup size takes the subgroup form of the group
    scores (router_select.glsl), the others the loop; both give the float64 router's experts and weights, exact
    group ties included."""
    k = 8
    w, x = _exact_rows(_group_rows(n_experts, n_group, seed=n_group + n_experts))
    for topk_group in (1, max(1, n_group // 4), n_group // 2):
        ids, wts = _route_k(device, "dots", w, x, k, n_group=n_group, topk_group=topk_group, norm=True,
                            routed_scaling_factor=2.0)
        ids64, w64 = sigmoid_group_topk(router_logits(x, w, np.float64), None, k, n_group, topk_group, True, 2.0)
        assert np.array_equal(ids, ids64), (n_group, topk_group)
        np.testing.assert_allclose(wts, w64, rtol=2e-6, atol=1e-7)


@pytest.mark.parametrize("n_group", [32, 8])
def test_group_scores_skip_nan_choices(device, n_group):
    """NaN logits inside a group do not count towards its score (the loop form skips them; the subgroup form
    takes them as -inf): a group whose best logit is NaN scores by its numbers."""
    n_experts, k, per = 256, 8, 256 // n_group
    vals = np.full((1, n_experts), -4.0)
    vals[0, 0 * per + 1], vals[0, 0 * per + 2] = 1.0, 0.75           # group 0: 1.0 + 0.75
    vals[0, 1 * per + 0], vals[0, 1 * per + 3] = 3.0, 0.5            # group 1: NaN at per + 0, then 0.5 + -4.0
    vals[0, 2 * per + 2], vals[0, 2 * per + 3] = 0.5, 0.25           # group 2: 0.5 + 0.25
    w, x = _exact_rows(vals)
    w[1 * per + 0, 0] = np.nan
    z = router_logits(x, w, np.float64)
    ids, wts = _route_k(device, "dots", w, x, k, n_group=n_group, topk_group=2, norm=True, routed_scaling_factor=1.0)
    ids64, w64 = sigmoid_group_topk(z, None, k, n_group, 2, True, 1.0)
    assert set(ids64[0] // per) == {0, 2}  # group 1's NaN did not count
    assert np.array_equal(ids, ids64)
    np.testing.assert_allclose(wts, w64, rtol=2e-6, atol=1e-7)


def test_router_refuses_bad_arguments(device):
    w = _weights(0)
    with pytest.raises(ValueError, match="family"):
        DeviceRouter(device, "softmax", w, K)
    with pytest.raises(ValueError, match="top_k=65"):
        DeviceRouter(device, "std", w, 65)
    with pytest.raises(ValueError, match="n_group=5"):
        DeviceRouter(device, "dots", w, K, n_group=5, topk_group=2)
    with pytest.raises(ValueError, match="tid2eid"):
        DeviceRouter(device, "sqrtsp_hash", w, K)
    with pytest.raises(ValueError, match="H a multiple of 8"):
        DeviceRouter(device, "std", w[:, :252], K)
    r = DeviceRouter(device, "std", w, K)
    with pytest.raises(ValueError, match=r"hidden: expected \(m, 256\)"):
        r(np.zeros((2, 128), np.float16))
    r.close()


def test_router_at_the_size_limits(device):
    """E = 1024 (the op's limit) and H = 4096: 256 GEMV workgroups per token, the last of which selects; every
    loop stays far below Mesa 22.3's 65,536-iteration cap."""
    rng = np.random.default_rng(40)
    E_big, H_big = 1024, 4096
    w = (rng.standard_normal((E_big, H_big)) / 64).astype(np.float16)
    x = rng.standard_normal((3, H_big)).astype(np.float16)
    bias = (0.05 * rng.standard_normal(E_big)).astype(np.float32)
    router = DeviceRouter(device, "dots", w, 8, bias=bias, n_group=16, topk_group=4, norm=True,
                          routed_scaling_factor=2.5)
    try:
        ids, wts = router(x)
    finally:
        router.close()
    ids64, w64 = sigmoid_group_topk(router_logits(x, w, np.float64), bias, 8, 16, 4, True, 2.5)
    assert np.array_equal(ids, ids64)
    np.testing.assert_allclose(wts, w64, rtol=2e-6, atol=1e-7)


@pytest.mark.parametrize("kind", ["float16", "bfloat16", "float32"])
def test_router_gemv_over_several_rounds_of_loads(device, kind):
    """H = 9224: one full round of ROUTER_PASSES_IN_FLIGHT passes over H (8192 columns), then a partial pass and
    a ragged end, for every weight kind, fp16 and fp32 hidden: the selection equals the float64 reference's."""
    rng = np.random.default_rng(41)
    E_small, H_long = 10, 9224  # 3 GEMV workgroups, the last with 2 experts
    w = (rng.standard_normal((E_small, H_long)) / 96).astype(np.float32)
    if kind == "bfloat16":
        w = (w.view(np.uint32) & 0xFFFF0000).view(np.float32)
    elif kind == "float16":
        w = w.astype(np.float16)
    elif kind == "float32":
        w = w + np.float32(1e-7)  # not representable in bf16 or fp16: stays fp32
    assert weight_words(w)[1] == kind
    for x_dtype in (np.float16, np.float32):
        x = rng.standard_normal((3, H_long)).astype(x_dtype)
        router = DeviceRouter(device, "std", w, 4, norm=True)
        try:
            ids, wts = router(x)
        finally:
            router.close()
        ids64, w64 = softmax_topk(router_logits(x, w, np.float64), 4, True)
        assert np.array_equal(ids, ids64), (kind, x_dtype)
        np.testing.assert_allclose(wts, w64, rtol=2e-5, atol=1e-6)


def _exact_rows(values):
    """_exact_logits for m tokens: row t of x is the unit vector e_t, column t of W row t's logits (m <= H), so
    token t's logits are exactly values[t] (multiples of 1/4 in fp16's exact range)."""
    values = np.asarray(values, np.float64)
    m, n_experts = values.shape
    w, x = np.zeros((n_experts, H), np.float16), np.zeros((m, H), np.float16)
    x[np.arange(m), np.arange(m)] = 1.0
    w[:, :m] = values.T
    assert np.array_equal(router_logits(x, w, np.float64), values)
    return w, x


def _selection_rows(n_experts, k, seed):
    """Tokens whose top-k sits where a selection that splits the experts over invocations (invocation tid ranks
    experts tid, tid + 256, ...) or subgroups could go wrong: all in the first experts, several on one
    invocation (e, e + 256, ...), in the last, partial chunk of 256, tied across subgroups, all equal, and
    many-way ties everywhere. Distinct values are 1/4 apart in [-6, 4]: distinct in fp32 after every family's
    scoring, so the float64 reference's order is the device's."""
    rng = np.random.default_rng(seed)
    top = 4.0 - 0.25 * np.arange(k)                      # k distinct values above everything else
    rest = lambda: rng.integers(-24, -16, n_experts) / 4  # [-6, -4.25], ties among themselves
    rows = []
    r = rest(); r[:k] = top; rows.append(r)              # experts 0 .. k-1
    r = rest(); lanes = np.arange(0, n_experts, 256)
    same_lane = np.concatenate([lanes + i for i in range(256)])
    same_lane = same_lane[same_lane < n_experts][:k]
    r[same_lane] = top; rows.append(r)                   # 0, 256, 512, ..., 1, 257, ...: one invocation's first
    r = rest(); r[n_experts - k:] = top[::-1]; rows.append(r)  # the last k, ascending
    r = rest(); r[rng.permutation(n_experts)[:min(n_experts, 2 * k)]] = 3.0; rows.append(r)  # 2k tied at the top
    rows.append(np.zeros(n_experts))                     # all equal
    rows.append(rng.integers(-2, 2, n_experts) / 4)      # four values: ties everywhere
    r = rng.integers(-24, 16, n_experts) / 4; rows.append(r)  # random, with ties
    return np.stack(rows)


SELECTION_FAMILIES = {
    "std": (dict(norm=True), lambda z, k: softmax_topk(z, k, True)),
    "dots": (dict(norm=True, routed_scaling_factor=1.0), lambda z, k: sigmoid_group_topk(z, None, k, 1, 1, True, 1.0)),
    "sqrtsp": (dict(routed_scaling_factor=1.0), lambda z, k: sqrtsp_topk(z, None, k, 1.0)),
}


def _route_k(device, family, weight, x, k, **kw):
    router = DeviceRouter(device, family, weight, k, **kw)
    try:
        return router(x)
    finally:
        router.close()


@pytest.mark.parametrize("n_experts,k", [(300, 8), (300, 32), (72, 2), (520, 1), (1000, 7), (1024, 32)])
@pytest.mark.parametrize("family", sorted(SELECTION_FAMILIES))
def test_selection_matches_the_reference_where_the_split_matters(device, family, n_experts, k):
    """select_topk gives the float64 router's slots, order and tie rule for E not a multiple of 256, up to
    ROUTE_MAX_EXPERTS and MAX_TOP_K, with the top-k placed where splitting the experts over invocations or
    subgroups would go wrong (_selection_rows)."""
    kw, numpy_router = SELECTION_FAMILIES[family]
    w, x = _exact_rows(_selection_rows(n_experts, k, seed=n_experts + k))
    ids, wts = _route_k(device, family, w, x, k, **kw)
    ids64, w64 = numpy_router(router_logits(x, w, np.float64), k)
    assert np.array_equal(ids, ids64)
    np.testing.assert_allclose(wts, w64, rtol=2e-6, atol=1e-7)


def test_selection_takes_minus_inf_experts_in_index_order(device):
    """dots, 64 groups of 5, one kept (group 60): top_k = 8 takes its 5 experts, then three dropped (-inf) experts,
    the lowest indices (0, 1, 2); nothing stays NONE."""
    n_experts, k = 320, 8
    vals = np.full((1, n_experts), -1.0)
    vals[0, 300:305] = [2.0, 1.0, 1.5, 0.5, 2.0]
    w, x = _exact_rows(vals)
    ids, wts = _route_k(device, "dots", w, x, k, n_group=64, topk_group=1, norm=True, routed_scaling_factor=1.0)
    ids64, w64 = sigmoid_group_topk(router_logits(x, w, np.float64), None, k, 64, 1, True, 1.0)
    assert ids.tolist() == [[300, 304, 302, 301, 303, 0, 1, 2]] == ids64.tolist()
    np.testing.assert_allclose(wts, w64, rtol=2e-6, atol=1e-7)


@pytest.mark.parametrize("n_experts", [64, 300])
def test_selection_never_takes_a_nan_choice(device, n_experts):
    """NaN logits (a NaN weight) give NaN choice values (dots: sigmoid): never taken, beaten by every expert,
    also where they sit among the largest values and on the invocation that holds a winner."""
    k = 8
    vals = np.full((1, n_experts), -2.0)
    vals[0, [0, 1, 2, 3, 40, 41]] = [3.0, 2.75, 2.5, 2.25, 2.0, 1.75]
    w, x = _exact_rows(vals)
    nan_at = [e for e in (1, 5, 40, 256, 257, 299) if e < n_experts]
    w[nan_at, 0] = np.nan
    z = router_logits(x, w, np.float64)
    assert np.isnan(z[0, nan_at]).all()
    ids, wts = _route_k(device, "dots", w, x, k, norm=True, routed_scaling_factor=1.0)
    ids64, w64 = sigmoid_group_topk(z, None, k, 1, 1, True, 1.0)
    assert not set(ids64[0].tolist()) & set(nan_at)
    assert np.array_equal(ids, ids64)
    np.testing.assert_allclose(wts, w64, rtol=2e-6, atol=1e-7)


@pytest.mark.parametrize("n_experts,k", [(64, 8), (300, 8), (1024, 32)])
@pytest.mark.parametrize("family", sorted(SELECTION_FAMILIES))
def test_tokens_with_fewer_numbers_than_top_k_take_nan_experts_in_index_order(device, family, n_experts, k):
    """Fewer than top_k choice values are numbers: the numbers first (descending), then the NaN experts in index
    order, as the float64 router's stable sort gives them; their weights are NaN, so the token's output is NaN,
    not a zero row. Every logit NaN (what a NaN hidden value gives); three numbers among NaN experts; k numbers
    exactly (no NaN is taken). One token per router call: a NaN weight would make every token's logit NaN."""
    kw, numpy_router = SELECTION_FAMILIES[family]
    numbers = {"all NaN": {}, "three numbers": {5: 2.0, n_experts - 1: 1.5, 17: -1.0},
               "k numbers": {e: 2.0 - 0.25 * e for e in range(k)}}
    for case, known in numbers.items():
        vals = np.zeros((1, n_experts))
        vals[0, list(known)] = list(known.values())
        w, x = _exact_rows(vals)
        nan_experts = [e for e in range(n_experts) if e not in known]
        w[nan_experts, 0] = np.nan
        with np.errstate(invalid="ignore"):
            z = router_logits(x, w, np.float64)
            ids64, w64 = numpy_router(z, k)
        if family == "std" and nan_experts:  # (softmax: one NaN logit makes every score NaN)
            want = list(range(k))
        else:
            want = sorted(known, key=lambda e: (-known[e], e))[:k] + nan_experts[:max(0, k - len(known))]
        assert ids64[0].tolist() == want, case
        ids, wts = _route_k(device, family, w, x, k, **kw)
        assert np.array_equal(ids, ids64), (case, ids, ids64)
        np.testing.assert_allclose(wts, w64, rtol=2e-6, atol=1e-7, equal_nan=True, err_msg=case)
        assert np.isnan(wts).all() if nan_experts and (family == "std" or len(known) < k) else \
            np.isfinite(wts).all(), (case, wts)
