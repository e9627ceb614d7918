/* threadpool.c — see threadpool.h. Workers wait for a job generation number: they spin
 * briefly (jobs come in bursts, one per matmul, during a forward pass) and then sleep on a
 * condition variable. Items are claimed with an atomic counter. A try-lock serialises jobs;
 * a caller that finds the pool busy runs its job inline instead of waiting.
 *
 * A worker joins a job only while it is open: `state` packs the job's generation, a closed
 * flag and the number of workers inside, so joining is one compare-and-swap that fails once
 * the caller has closed the job (after claiming the last item) or a newer job replaced it.
 * The caller then waits only for the workers inside, which are finishing claimed items: a
 * worker that wakes late (descheduled on a busy machine) costs the caller nothing. */
#include "cpu/threadpool.h"

#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdint.h>

#include "base/alloc.h"
#include "base/errors.h"

enum { SPIN_ROUNDS = 20000 };

/* state: generation << 33 | closed << 32 | workers inside. The generation's top bit drops out:
 * a worker would have to sleep through 2^31 jobs to mistake an old job for the current one. */
#define STATE_CLOSED ((uint64_t)1 << 32)
#define STATE_INSIDE ((uint64_t)0xffffffff)
static uint64_t state_open(unsigned generation) { return (uint64_t)generation << 33; }

/* A worker thread and what it is started with (owned by the pool, so a thread that starts
 * late frees nothing behind anyone's back). */
typedef struct pool_worker {
    pthread_t thread;
    tl_pool* pool;
    unsigned index;
} pool_worker;

struct tl_pool {
    unsigned n_threads;
    pool_worker* workers;      /* [n_threads - 1] */
    pthread_mutex_t submit;    /* held by the caller running a job */
    pthread_mutex_t mutex;     /* guards sleeping / waking */
    pthread_cond_t wake;
    pthread_cond_t done;
    atomic_uint generation;    /* bumped for every job (and for shutdown) */
    atomic_bool stopping;
    /* the current job */
    tl_task_fn fn;
    void* ctx;
    size_t n_items;
    atomic_size_t next_item;
    _Atomic uint64_t state;    /* see state_open */
};

static void run_items(tl_pool* p, unsigned worker) {
    for (;;) {
        size_t item = atomic_fetch_add(&p->next_item, 1);
        if (item >= p->n_items) break;
        p->fn(p->ctx, item, worker);
    }
}

static unsigned wait_generation(tl_pool* p, unsigned seen) {
    for (int i = 0; i < SPIN_ROUNDS; i++) {
        unsigned g = atomic_load_explicit(&p->generation, memory_order_acquire);
        if (g != seen) return g;
        if (i % 64 == 63) sched_yield();
    }
    pthread_mutex_lock(&p->mutex);
    unsigned g;
    while ((g = atomic_load(&p->generation)) == seen) pthread_cond_wait(&p->wake, &p->mutex);
    pthread_mutex_unlock(&p->mutex);
    return g;
}

/* Enter job `generation` if it is still open. */
static bool join_job(tl_pool* p, unsigned generation) {
    uint64_t s = atomic_load_explicit(&p->state, memory_order_acquire);
    while (s == state_open(generation) + (s & STATE_INSIDE))
        if (atomic_compare_exchange_weak_explicit(&p->state, &s, s + 1, memory_order_acquire, memory_order_relaxed))
            return true;
    return false;
}

static void leave_job(tl_pool* p) {
    const uint64_t s = atomic_fetch_sub_explicit(&p->state, 1, memory_order_acq_rel) - 1;
    if ((s & STATE_CLOSED) && (s & STATE_INSIDE) == 0) {
        pthread_mutex_lock(&p->mutex);
        pthread_cond_signal(&p->done);
        pthread_mutex_unlock(&p->mutex);
    }
}

static void* worker_main(void* arg) {
    tl_pool* p = ((pool_worker*)arg)->pool;
    const unsigned index = ((pool_worker*)arg)->index;
    unsigned seen = 0;
    for (;;) {
        seen = wait_generation(p, seen);
        if (atomic_load(&p->stopping)) return NULL;
        if (!join_job(p, seen)) continue;
        run_items(p, index);
        leave_job(p);
    }
}

static void stop_workers(tl_pool* p, unsigned started) {
    pthread_mutex_lock(&p->mutex);
    atomic_store(&p->stopping, true);
    atomic_fetch_add(&p->generation, 1);
    pthread_cond_broadcast(&p->wake);
    pthread_mutex_unlock(&p->mutex);
    for (unsigned i = 0; i < started; i++) pthread_join(p->workers[i].thread, NULL);
}

tl_status tl_pool_create(unsigned n_threads, tl_pool** out) {
    *out = NULL;
    if (n_threads < 1) n_threads = 1;
    tl_pool* p = tl_alloc_zeroed(1, sizeof *p);
    if (!p) return tl_fail_oom("thread pool");
    p->n_threads = n_threads;
    p->workers = tl_alloc_zeroed(n_threads, sizeof(pool_worker));
    if (!p->workers) {
        tl_free(p);
        return tl_fail_oom("thread pool");
    }
    pthread_mutex_init(&p->submit, NULL);
    pthread_mutex_init(&p->mutex, NULL);
    pthread_cond_init(&p->wake, NULL);
    pthread_cond_init(&p->done, NULL);
    tl_status st = TL_OK;
    unsigned started = 0;
    for (; started + 1 < n_threads; started++) {
        pool_worker* w = &p->workers[started];
        w->pool = p;
        w->index = started + 1;
        if (pthread_create(&w->thread, NULL, worker_main, w) != 0) {
            st = tl_fail(TL_ERR_INTERNAL, "cannot start worker thread %u of %u", started + 1, n_threads);
            break;
        }
    }
    if (st != TL_OK) {
        p->n_threads = started + 1;
        tl_pool_destroy(p);
        return st;
    }
    *out = p;
    return TL_OK;
}

void tl_pool_destroy(tl_pool* p) {
    if (!p) return;
    stop_workers(p, p->n_threads - 1);
    pthread_mutex_destroy(&p->submit);
    pthread_mutex_destroy(&p->mutex);
    pthread_cond_destroy(&p->wake);
    pthread_cond_destroy(&p->done);
    tl_free(p->workers);
    tl_free(p);
}

unsigned tl_pool_threads(const tl_pool* p) { return p->n_threads; }

void tl_pool_run(tl_pool* p, size_t n_items, tl_task_fn fn, void* ctx) {
    if (n_items == 0) return;
    if (p->n_threads == 1 || n_items == 1 || pthread_mutex_trylock(&p->submit) != 0) {
        for (size_t i = 0; i < n_items; i++) fn(ctx, i, 0);
        return;
    }
    p->fn = fn;
    p->ctx = ctx;
    p->n_items = n_items;
    atomic_store(&p->next_item, 0);
    const unsigned generation = atomic_load(&p->generation) + 1;
    atomic_store_explicit(&p->state, state_open(generation), memory_order_release);
    pthread_mutex_lock(&p->mutex);
    atomic_store_explicit(&p->generation, generation, memory_order_release);
    pthread_cond_broadcast(&p->wake);
    pthread_mutex_unlock(&p->mutex);
    run_items(p, 0);
    /* every item is claimed: close the job, then wait for the workers inside it */
    atomic_fetch_or_explicit(&p->state, STATE_CLOSED, memory_order_acq_rel);
    for (int i = 0; i < SPIN_ROUNDS && (atomic_load(&p->state) & STATE_INSIDE) != 0; i++)
        if (i % 64 == 63) sched_yield();
    if ((atomic_load(&p->state) & STATE_INSIDE) != 0) {
        pthread_mutex_lock(&p->mutex);
        while ((atomic_load(&p->state) & STATE_INSIDE) != 0) pthread_cond_wait(&p->done, &p->mutex);
        pthread_mutex_unlock(&p->mutex);
    }
    pthread_mutex_unlock(&p->submit);
}
