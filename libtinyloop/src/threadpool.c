/* threadpool.c — see threadpool.h. Workers wait for a job generation number: they spin
 * briefly (jobs come in bursts, one per matmul, during a forward pass) and then sleep on a
 * condition variable. Items are claimed with an atomic counter. A try-lock serialises jobs;
 * a caller that finds the pool busy runs its job inline instead of waiting. */
#include "threadpool.h"

#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdbool.h>

#include "alloc.h"
#include "errors.h"

enum { SPIN_ROUNDS = 20000 };

struct tl_pool {
    unsigned n_threads;
    pthread_t* workers;        /* [n_threads - 1] */
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
    atomic_uint busy_workers;  /* workers that have not finished the current job */
};

typedef struct worker_arg {
    tl_pool* pool;
    unsigned index;
} worker_arg;

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

static void* worker_main(void* arg) {
    tl_pool* p = ((worker_arg*)arg)->pool;
    const unsigned index = ((worker_arg*)arg)->index;
    tl_free(arg);
    unsigned seen = 0;
    for (;;) {
        seen = wait_generation(p, seen);
        if (atomic_load(&p->stopping)) return NULL;
        run_items(p, index);
        if (atomic_fetch_sub(&p->busy_workers, 1) == 1) {
            pthread_mutex_lock(&p->mutex);
            pthread_cond_signal(&p->done);
            pthread_mutex_unlock(&p->mutex);
        }
    }
}

static void stop_workers(tl_pool* p, unsigned started) {
    pthread_mutex_lock(&p->mutex);
    atomic_store(&p->stopping, true);
    atomic_fetch_add(&p->generation, 1);
    pthread_cond_broadcast(&p->wake);
    pthread_mutex_unlock(&p->mutex);
    for (unsigned i = 0; i < started; i++) pthread_join(p->workers[i], NULL);
}

tl_status tl_pool_create(unsigned n_threads, tl_pool** out) {
    *out = NULL;
    if (n_threads < 1) n_threads = 1;
    tl_pool* p = tl_alloc_zeroed(1, sizeof *p);
    if (!p) return tl_fail_oom("thread pool");
    p->n_threads = n_threads;
    p->workers = tl_alloc_zeroed(n_threads, sizeof(pthread_t));
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
        worker_arg* arg = tl_alloc(sizeof *arg);
        if (!arg) {
            st = tl_fail_oom("thread pool");
            break;
        }
        arg->pool = p;
        arg->index = started + 1;
        if (pthread_create(&p->workers[started], NULL, worker_main, arg) != 0) {
            tl_free(arg);
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
    atomic_store(&p->busy_workers, p->n_threads - 1);
    pthread_mutex_lock(&p->mutex);
    atomic_fetch_add_explicit(&p->generation, 1, memory_order_release);
    pthread_cond_broadcast(&p->wake);
    pthread_mutex_unlock(&p->mutex);
    run_items(p, 0);
    for (int i = 0; i < SPIN_ROUNDS && atomic_load(&p->busy_workers) != 0; i++)
        if (i % 64 == 63) sched_yield();
    if (atomic_load(&p->busy_workers) != 0) {
        pthread_mutex_lock(&p->mutex);
        while (atomic_load(&p->busy_workers) != 0) pthread_cond_wait(&p->done, &p->mutex);
        pthread_mutex_unlock(&p->mutex);
    }
    pthread_mutex_unlock(&p->submit);
}
