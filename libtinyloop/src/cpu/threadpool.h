/* threadpool.h — a persistent pool of worker threads per model.
 *
 * tl_pool_run(pool, n_items, fn, ctx) calls fn(ctx, item, worker) once for every item in
 * [0, n_items), spread over the pool's threads plus the calling thread, and returns when all
 * are done. `worker` is in [0, tl_pool_threads(pool)) and unique among concurrently running
 * calls of one run, so it can index per-worker scratch. Items must be independent: results
 * never depend on which thread ran which item. If another thread is already running a job on
 * the pool, the caller runs its items itself (worker 0 of its own run): a model is usable from
 * many threads at once without waiting on each other. */
#ifndef TL_THREADPOOL_H
#define TL_THREADPOOL_H

#include <stddef.h>

#include "tinyloop.h"

typedef struct tl_pool tl_pool;
typedef void (*tl_task_fn)(void* ctx, size_t item, unsigned worker);

/* n_threads >= 1 counts the calling thread, so n_threads - 1 workers are started. */
tl_status tl_pool_create(unsigned n_threads, tl_pool** out);
void tl_pool_destroy(tl_pool* pool);
unsigned tl_pool_threads(const tl_pool* pool);
void tl_pool_run(tl_pool* pool, size_t n_items, tl_task_fn fn, void* ctx);

#endif
