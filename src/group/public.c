/* group/public.c: the group's read-only public calls that tools and users need: statistics
 * and the buffer plan, as plain public structs (the internals stay unexported). */
#include <stdio.h>
#include <string.h>

#include "core/core.h"
#include "group/group.h"
#include "kernels/kernels.h"
#include "layout/plan.h"

int hep_group_get_stats(const hep_group *g, hep_group_stats *s)
{
    if (!g || !s)
        return hep_fail(HEP_ERR_INVALID, "hep_group_get_stats: NULL argument");
    memset(s, 0, sizeof(*s));
    snprintf(s->transport, sizeof(s->transport), "%s",
             g->coord ? g->coord->net->v->name : "none");
    hep_ep_fill_stats(g, s);
    return HEP_OK;
}

int hep_plan_query(const hep_config *cfg, int nodes, int ranks_per_node, hep_plan_info *out)
{
    hep_plan p;
    hep_config c;
    int rc;
    if (!cfg || !out)
        return hep_fail(HEP_ERR_INVALID, "hep_plan_query: NULL argument");
    c = *cfg;
    c.ranks_per_node = ranks_per_node;
    rc = hep_plan_make(&c, nodes, ranks_per_node, &p);
    if (rc != HEP_OK)
        return rc;
    /* the public arrays must hold the plan; a build that grows past them is a bug here */
    _Static_assert(HEP_BUF_COUNT <= HEP_PLAN_MAX_BUFFERS, "grow HEP_PLAN_MAX_BUFFERS");
    _Static_assert(HEP_ARENA_COUNT <= HEP_PLAN_MAX_ARENAS, "grow HEP_PLAN_MAX_ARENAS");
    memset(out, 0, sizeof(*out));
    out->nodes = p.nodes;
    out->ranks_per_node = p.ranks_per_node;
    out->world = p.world;
    out->max_recv_rows = p.max_recv_rows;
    out->device_bytes = p.device_bytes;
    out->host_bytes = p.host_bytes;
    out->chunk_tokens = p.chunk;
    out->ring_chunks = p.ring;
    out->slot_tokens = p.slot_tokens;
    for (int i = 0; i < HEP_BUF_COUNT; i++) {
        const hep_plan_buffer *b = &p.buf[i];
        hep_plan_buffer_info *o = &out->buffers[out->num_buffers];
        if (!b->present)
            continue;
        o->name = b->name;
        o->role = b->role;
        o->elem = b->elem;
        o->memory = hep_arena_name(b->arena);
        o->shares_bytes_with = b->alias_of >= 0 ? p.buf[b->alias_of].name : NULL;
        o->count = b->count;
        o->bytes = b->bytes;
        o->align = b->align;
        o->offset = b->offset;
        o->rdma_registered = b->registered;
        out->num_buffers++;
    }
    out->num_arenas = HEP_ARENA_COUNT;
    for (int a = 0; a < HEP_ARENA_COUNT; a++) {
        out->arenas[a].name = hep_arena_name(a);
        out->arenas[a].bytes = p.arena_bytes[a];
    }
    return HEP_OK;
}

int hep_gpu_probe(int cuda_device)
{
    char why[512] = "";
    if (hep_kernels_probe(cuda_device, why, sizeof(why)) != 0)
        return hep_fail(HEP_ERR_UNAVAILABLE, "GPU %d: %s", cuda_device, why);
    return HEP_OK;
}

size_t hep_struct_size(const char *name)
{
    static const struct {
        const char *name;
        size_t size;
    } known[] = {
        {"hep_config", sizeof(hep_config)},
        {"hep_bootstrap", sizeof(hep_bootstrap)},
        {"hep_group_info", sizeof(hep_group_info)},
        {"hep_dispatch_args", sizeof(hep_dispatch_args)},
        {"hep_dispatch_result", sizeof(hep_dispatch_result)},
        {"hep_combine_args", sizeof(hep_combine_args)},
        {"hep_dispatch_opts", sizeof(hep_dispatch_opts)},
        {"hep_combine_opts", sizeof(hep_combine_opts)},
        {"hep_group_stats", sizeof(hep_group_stats)},
        {"hep_plan_buffer_info", sizeof(hep_plan_buffer_info)},
        {"hep_plan_info", sizeof(hep_plan_info)},
    };
    for (size_t i = 0; name && i < sizeof(known) / sizeof(known[0]); i++)
        if (strcmp(name, known[i].name) == 0)
            return known[i].size;
    return 0;
}
