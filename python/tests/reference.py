"""Plain-torch reference of dispatch and combine (no hybridep), and the inputs of a case:
every rank computes every rank's inputs from the seed."""
import torch


def inputs(seed, rank, T, H, E, K, index_dtype=torch.int64, ragged=True, fp8=False):
    g = torch.Generator().manual_seed(seed * 1000 + rank)
    t = int(torch.randint(0, T + 1, (1,), generator=g)) if ragged else T
    if fp8:
        hidden = torch.randint(0, 256, (t, H), generator=g, dtype=torch.int64).to(torch.uint8)
        hidden[(hidden & 0x7F) == 0x7F] = 0  # no NaN encodings
        scales = torch.rand((t, H // 128), generator=g)
    else:
        hidden = (torch.randn((t, H), generator=g) * 4).to(torch.bfloat16)
        scales = None
    idx = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(t)]) if t else \
        torch.empty((0, K), dtype=torch.int64)
    drop = torch.rand((t, K), generator=g) < 0.15
    idx[drop] = -1
    weights = torch.rand((t, K), generator=g)
    return hidden, idx.to(index_dtype), weights, scales


def dispatch(all_inputs, rank, El):
    """What `rank` receives: rows in [source rank][token] order, probs [recv, El],
    tokens per local expert, and the (source, token) of each row."""
    rows, probs, scales, origin = [], [], [], []
    tpe = torch.zeros(El, dtype=torch.int64)
    lo = rank * El
    for s, (hidden, idx, w, sc) in enumerate(all_inputs):
        for i in range(hidden.shape[0]):
            ids = idx[i].to(torch.int64)
            mine = (ids >= lo) & (ids < lo + El)
            if not bool(mine.any()):
                continue
            p = torch.zeros(El)
            for k in torch.nonzero(mine).flatten().tolist():
                p[int(ids[k]) - lo] += w[i, k]
            tpe += torch.bincount(torch.unique(ids[mine]) - lo, minlength=El)
            rows.append(hidden[i])
            probs.append(p)
            origin.append((s, i))
            if sc is not None:
                scales.append(sc[i])
    H = all_inputs[0][0].shape[1]
    dt = all_inputs[0][0].dtype
    rows = torch.stack(rows) if rows else torch.empty((0, H), dtype=dt)
    probs = torch.stack(probs) if probs else torch.empty((0, El))
    scales = torch.stack(scales) if scales else None
    return rows, probs, tpe, origin, scales


def combine(expert_out_by_rank, origins_by_rank, rank, t, H):
    """For each of `rank`'s t tokens: f32 sum over destinations (ascending rank), BF16."""
    acc = torch.zeros((t, H), dtype=torch.float32)
    for d, (out, origin) in enumerate(zip(expert_out_by_rank, origins_by_rank)):
        for j, (s, i) in enumerate(origin):
            if s == rank:
                acc[i] += out[j].float()
    return acc.to(torch.bfloat16)


def combine_nodes(expert_out_by_rank, origins_by_rank, rank, t, H, R):
    """combine() across nodes of R ranks: the own node's destinations in f32 (ascending
    rank), then each other node's partial sum (its destinations in f32, ascending) rounded
    to BF16, in node order; BF16 at the end."""
    W = len(expert_out_by_rank)
    own, N = rank // R, W // R
    acc = torch.zeros((t, H), dtype=torch.float32)
    part = torch.zeros((N, t, H), dtype=torch.float32)
    hit = torch.zeros((N, t), dtype=torch.bool)
    for d, (out, origin) in enumerate(zip(expert_out_by_rank, origins_by_rank)):
        m = d // R
        for j, (s, i) in enumerate(origin):
            if s != rank:
                continue
            if m == own:
                acc[i] += out[j].float()
            else:
                part[m, i] += out[j].float()
                hit[m, i] = True
    for m in range(N):
        if m != own:
            acc[hit[m]] += part[m][hit[m]].to(torch.bfloat16).float()
    return acc.to(torch.bfloat16)
