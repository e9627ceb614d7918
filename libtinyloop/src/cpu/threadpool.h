/* threadpool.h — the process's worker threads, shared by every model, and a model's share of them.
 *
 * One crew of worker threads serves the whole process. It starts with the first model that
 * wants more than one thread and grows to the largest n_threads any model has asked for (it
 * never shrinks; its threads stop when the library is unloaded or the process exits, and a
 * child of fork() starts its own). A tl_pool is one model's share: tl_pool_run(pool, n_items,
 * fn, ctx) calls fn(ctx, item, worker) once for every item in [0, n_items), spread over at most
 * tl_pool_threads(pool) threads, the calling thread included, and returns when all are done.
 * `worker` is in [0, tl_pool_threads(pool)) and unique among the concurrently running calls of
 * one run, so it can index per-worker scratch. Items must be independent: results never depend
 * on which thread ran which item or how many took part.
 *
 * The crew runs one job at a time: a caller that finds it busy with another caller's job (of
 * any model) runs its own items itself, as worker 0, and never waits for the other job. Idle
 * workers spin for a few microseconds (the jobs of a forward pass come back to back), then
 * sleep: a process that is not computing uses no CPU. */
#ifndef TL_THREADPOOL_H
#define TL_THREADPOOL_H

#include <stddef.h>

#include "tinyloop.h"

enum { TL_POOL_MAX_THREADS = 1024 }; /* the most threads a share may have, and the crew's size (tinyloop/params.py MAX_THREADS) */

typedef struct tl_pool tl_pool;
typedef void (*tl_task_fn)(void* ctx, size_t item, unsigned worker);

/* A share of n_threads threads (1 .. TL_POOL_MAX_THREADS, the calling thread counted), starting
 * workers until the crew has n_threads - 1. TL_ERR_INTERNAL if a thread cannot start (those
 * already started stay in the crew), TL_ERR_OUT_OF_MEMORY. */
tl_status tl_pool_create(unsigned n_threads, tl_pool** out);
void tl_pool_destroy(tl_pool* pool);
unsigned tl_pool_threads(const tl_pool* pool);
void tl_pool_run(tl_pool* pool, size_t n_items, tl_task_fn fn, void* ctx);

#endif
