#include <dirent.h>
#include <pthread.h>
#include <stdlib.h>
#include <stdio.h>
#include <string.h>

#include "core/core.h"
#include "ranks.h"

static void *rank_main(void *p)
{
    rank_ctx *r = p;
    r->rc = r->fn(r);
    snprintf(r->err, sizeof(r->err), "%s", hep_last_error());
    return NULL;
}

int run_ranks(int world, rank_fn fn, void *arg, rank_ctx *ctx)
{
    hep_inproc_world *w;
    pthread_t *th = malloc(sizeof(*th) * (size_t)(world > 0 ? world : 1));
    int rc = th ? hep_inproc_world_create(world, &w) : -1;
    if (rc) {
        free(th);
        return -1;
    }
    for (int r = 0; r < world; r++) {
        memset(&ctx[r], 0, sizeof(ctx[r]));
        hep_inproc_bootstrap(w, r, &ctx[r].bs);
        ctx[r].rank = r;
        ctx[r].world = world;
        ctx[r].arg = arg;
        ctx[r].fn = fn;
    }
    for (int r = 0; r < world; r++)
        pthread_create(&th[r], NULL, rank_main, &ctx[r]);
    for (int r = 0; r < world; r++)
        pthread_join(th[r], NULL);
    hep_inproc_world_destroy(w);
    free(th);
    return 0;
}

static int count_dir(const char *path)
{
    DIR *d = opendir(path);
    struct dirent *e;
    int n = 0;
    if (!d)
        return -1;
    while ((e = readdir(d)))
        n += e->d_name[0] != '.';
    closedir(d);
    return n - (strcmp(path, "/proc/self/fd") == 0); /* the DIR's own fd */
}

int count_fds(void)
{
    return count_dir("/proc/self/fd");
}

int count_threads(void)
{
    return count_dir("/proc/self/task");
}
