/* threadpool.c — see threadpool.h. The crew is one static object, so sharing it needs no
 * allocation and no reference counting; a tl_pool only carries its thread count.
 *
 * Workers wait for a job generation number: they spin for at most SPIN_NS (jobs come in
 * bursts, one per matmul, during a forward pass) and then sleep, each on its own semaphore; a
 * caller wakes only as many sleepers as its job has seats, by name (no herd when a small share
 * uses a large crew, and no guessing which waiter a condition variable woke). Items are
 * claimed with an atomic counter. A try-lock serialises jobs; a caller that finds the crew busy
 * runs its job inline.
 *
 * A worker joins a job only while it is open and has a free seat: `state` packs the job's
 * generation, a closed flag, the seats left and the number of workers inside, so joining is one
 * compare-and-swap that fails once the caller has closed the job (after claiming the last item),
 * a newer job replaced it, or its seats are taken. The seat a worker takes is its index in the
 * job, which keeps the indices below the share's thread count. The caller then waits only for
 * the workers inside, which are finishing claimed items (the last one out posts `done`): a
 * worker that wakes late (descheduled on a busy machine) costs the caller nothing.
 *
 * fork(): the handlers hold the crew's locks across the fork, so the child gets them in a known
 * state; its crew has no threads (they stay in the parent), and its first job starts as many as
 * the parent had. Unloading the library (or exiting) stops and joins the workers. */
#include "cpu/threadpool.h"

#include <pthread.h>
#include <sched.h>
#include <semaphore.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdint.h>
#include <time.h>

#include "base/alloc.h"
#include "base/errors.h"

/* How long an idle worker, or a caller waiting for the workers inside its job, spins before it
 * sleeps: longer than the gap between two jobs of a forward pass, short enough that a host
 * between two tokens pays next to nothing. */
enum { SPIN_NS = 50 * 1000 };

/* state: generation << 33 | closed << 32 | seats left << 16 | workers inside. The generation's
 * top bit drops out: a worker would have to sleep through 2^31 jobs to mistake an old job for
 * the current one. */
#define STATE_CLOSED ((uint64_t)1 << 32)
#define STATE_SEAT ((uint64_t)1 << 16)
#define STATE_INSIDE ((uint64_t)0xffff)
static uint64_t state_open(unsigned generation, unsigned seats) {
    return (uint64_t)generation << 33 | (uint64_t)seats << 16;
}
static bool state_is_open(uint64_t s, unsigned generation) {
    return (uint32_t)(s >> 32) == (uint32_t)(generation << 1); /* this generation, not closed */
}
static unsigned state_seats(uint64_t s) { return (unsigned)(s >> 16) & 0xffff; }

struct tl_pool {
    unsigned n_threads;
};

static struct crew {
    pthread_mutex_t grow;       /* held while threads start or stop                            */
    pthread_mutex_t submit;     /* held by the caller running a job                            */
    pthread_mutex_t mutex;      /* guards the stack of sleepers                                */
    pthread_t threads[TL_POOL_MAX_THREADS - 1];
    sem_t wake[TL_POOL_MAX_THREADS - 1];     /* posted when a job picks sleeping worker i      */
    unsigned asleep[TL_POOL_MAX_THREADS - 1]; /* [n_asleep] the sleeping workers, a stack      */
    unsigned n_asleep;
    sem_t done;                 /* posted by the last worker out of a closed job               */
    atomic_uint n_workers;      /* threads[0 .. n_workers) are running                         */
    unsigned lost;              /* threads a fork child has to restart                         */
    atomic_bool restart;        /* a fork child, lost > 0                                      */
    atomic_bool stopping;
    atomic_uint generation;     /* bumped for every job and for the stop                       */
    /* the current job, written by its caller before it opens the job */
    tl_task_fn fn;
    void* ctx;
    size_t n_items;
    atomic_size_t next_item;
    _Atomic uint64_t state;     /* see state_open                                              */
} crew = {.grow = PTHREAD_MUTEX_INITIALIZER, .submit = PTHREAD_MUTEX_INITIALIZER, .mutex = PTHREAD_MUTEX_INITIALIZER};

static pthread_once_t crew_once = PTHREAD_ONCE_INIT;

/* ---- waiting ----------------------------------------------------------------------------- */

static uint64_t now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (uint64_t)t.tv_sec * 1000000000u + (uint64_t)t.tv_nsec;
}

static void cpu_relax(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#elif defined(__aarch64__)
    __asm__ __volatile__("yield");
#endif
}

static bool generation_moved(unsigned seen) { return atomic_load(&crew.generation) != seen; }
static bool done_posted(unsigned unused) {
    (void)unused;
    return sem_trywait(&crew.done) == 0;
}

static void sem_wait_through_signals(sem_t* s) {
    while (sem_wait(s) != 0) {
    }
}

/* Spin until ready(arg) or SPIN_NS have passed (yielding now and then, for a busy machine);
 * true if ready. */
static bool spin_until(bool (*ready)(unsigned), unsigned arg) {
    const uint64_t start = now_ns();
    for (unsigned i = 1;; i++) {
        if (ready(arg)) return true;
        cpu_relax();
        if (i % 64 == 0) {
            if (now_ns() - start > SPIN_NS) return false;
            sched_yield();
        }
    }
}

/* ---- workers ----------------------------------------------------------------------------- */

static void run_items(unsigned worker) {
    for (;;) {
        const size_t item = atomic_fetch_add_explicit(&crew.next_item, 1, memory_order_relaxed);
        if (item >= crew.n_items) return;
        crew.fn(crew.ctx, item, worker);
    }
}

/* The next generation after `seen`; worker `self` sleeps if it does not come soon. */
static unsigned wait_generation(unsigned self, unsigned seen) {
    if (!spin_until(generation_moved, seen)) {
        pthread_mutex_lock(&crew.mutex);
        const bool sleep = !generation_moved(seen);
        if (sleep) crew.asleep[crew.n_asleep++] = self;
        pthread_mutex_unlock(&crew.mutex);
        if (sleep) sem_wait_through_signals(&crew.wake[self]); /* posted after the generation moved */
    }
    return atomic_load(&crew.generation);
}

/* Take a seat in job `generation` if it is still open: the seat number (1 ..), else 0. */
static unsigned join_job(unsigned generation) {
    uint64_t s = atomic_load_explicit(&crew.state, memory_order_acquire);
    while (state_is_open(s, generation) && state_seats(s) > 0)
        if (atomic_compare_exchange_weak_explicit(&crew.state, &s, s - STATE_SEAT + 1, memory_order_acquire,
                                                  memory_order_acquire))
            return state_seats(s);
    return 0;
}

static void leave_job(void) {
    const uint64_t s = atomic_fetch_sub_explicit(&crew.state, 1, memory_order_acq_rel) - 1;
    if ((s & STATE_CLOSED) && (s & STATE_INSIDE) == 0) sem_post(&crew.done);
}

static void* worker_main(void* arg) {
    const unsigned self = (unsigned)(uintptr_t)arg;
    unsigned seen = atomic_load(&crew.generation) - 1; /* a job open now is one to join */
    for (;;) {
        seen = wait_generation(self, seen);
        if (atomic_load(&crew.stopping)) return NULL;
        const unsigned worker = join_job(seen);
        if (!worker) continue;
        run_items(worker);
        leave_job();
    }
}

/* ---- starting and stopping ------------------------------------------------------------------ */

/* Start threads until the crew has `want`; false if one cannot start. Under crew.grow. */
static bool start_workers(unsigned want) {
    for (unsigned have = atomic_load(&crew.n_workers); have < want && !atomic_load(&crew.stopping); have++) {
        sem_init(&crew.wake[have], 0, 0);
        if (pthread_create(&crew.threads[have], NULL, worker_main, (void*)(uintptr_t)have) != 0) return false;
        atomic_store(&crew.n_workers, have + 1);
    }
    return true;
}

static void restart_after_fork(void) {
    pthread_mutex_lock(&crew.grow);
    if (atomic_load(&crew.restart)) {
        start_workers(crew.lost); /* best effort: a job runs on whatever threads there are */
        atomic_store(&crew.restart, false);
    }
    pthread_mutex_unlock(&crew.grow);
}

static void before_fork(void) {
    pthread_mutex_lock(&crew.grow);
    pthread_mutex_lock(&crew.submit); /* no job is running across the fork */
    pthread_mutex_lock(&crew.mutex);
}

static void after_fork_parent(void) {
    pthread_mutex_unlock(&crew.mutex);
    pthread_mutex_unlock(&crew.submit);
    pthread_mutex_unlock(&crew.grow);
}

/* The child's only thread is the one that forked: the workers stayed in the parent. */
static void after_fork_child(void) {
    crew.lost = atomic_load(&crew.n_workers);
    atomic_store(&crew.n_workers, 0);
    atomic_store(&crew.restart, crew.lost > 0);
    crew.n_asleep = 0;
    after_fork_parent();
}

static void crew_init(void) {
    sem_init(&crew.done, 0, 0);
    pthread_atfork(before_fork, after_fork_parent, after_fork_child);
}

/* Runs when the library is unloaded or the process exits: afterwards jobs run on their callers. */
__attribute__((destructor)) static void stop_workers(void) {
    pthread_mutex_lock(&crew.grow);
    pthread_mutex_lock(&crew.mutex);
    atomic_store(&crew.stopping, true);
    atomic_fetch_add(&crew.generation, 1);
    while (crew.n_asleep > 0) sem_post(&crew.wake[crew.asleep[--crew.n_asleep]]);
    pthread_mutex_unlock(&crew.mutex);
    const unsigned n = atomic_load(&crew.n_workers);
    atomic_store(&crew.n_workers, 0);
    for (unsigned i = 0; i < n; i++) pthread_join(crew.threads[i], NULL);
    pthread_mutex_unlock(&crew.grow);
}

/* ---- shares and jobs ------------------------------------------------------------------------ */

tl_status tl_pool_create(unsigned n_threads, tl_pool** out) {
    *out = NULL;
    if (n_threads < 1) n_threads = 1;
    if (n_threads > TL_POOL_MAX_THREADS)
        return tl_fail(TL_ERR_INVALID_ARGUMENT, "n_threads must be <= %d, got %u", TL_POOL_MAX_THREADS, n_threads);
    tl_pool* p = tl_alloc(sizeof *p);
    if (!p) return tl_fail_oom("thread pool");
    p->n_threads = n_threads;
    pthread_once(&crew_once, crew_init);
    pthread_mutex_lock(&crew.grow);
    const bool started = start_workers(n_threads - 1);
    const unsigned have = atomic_load(&crew.n_workers);
    pthread_mutex_unlock(&crew.grow);
    if (!started) {
        tl_free(p);
        return tl_fail(TL_ERR_INTERNAL, "cannot start worker thread %u of %u", have + 1, n_threads - 1);
    }
    *out = p;
    return TL_OK;
}

void tl_pool_destroy(tl_pool* p) { tl_free(p); }

unsigned tl_pool_threads(const tl_pool* p) { return p->n_threads; }

void tl_pool_run(tl_pool* p, size_t n_items, tl_task_fn fn, void* ctx) {
    if (n_items == 0) return;
    if (atomic_load_explicit(&crew.restart, memory_order_relaxed)) restart_after_fork();
    unsigned seats = p->n_threads - 1;
    const unsigned workers = atomic_load_explicit(&crew.n_workers, memory_order_relaxed);
    if (seats > workers) seats = workers;
    if (seats > n_items - 1) seats = (unsigned)(n_items - 1);
    if (seats == 0 || pthread_mutex_trylock(&crew.submit) != 0) {
        for (size_t i = 0; i < n_items; i++) fn(ctx, i, 0);
        return;
    }
    crew.fn = fn;
    crew.ctx = ctx;
    crew.n_items = n_items;
    atomic_store_explicit(&crew.next_item, 0, memory_order_relaxed);
    const unsigned generation = atomic_load(&crew.generation) + 1;
    atomic_store_explicit(&crew.state, state_open(generation, seats), memory_order_release);
    pthread_mutex_lock(&crew.mutex);
    atomic_store_explicit(&crew.generation, generation, memory_order_release);
    for (unsigned i = 0; i < seats && crew.n_asleep > 0; i++) sem_post(&crew.wake[crew.asleep[--crew.n_asleep]]);
    pthread_mutex_unlock(&crew.mutex);
    run_items(0);
    /* every item is claimed: close the job, then wait for the workers inside it (the last one
     * out posts `done` once) */
    const uint64_t s = atomic_fetch_or_explicit(&crew.state, STATE_CLOSED, memory_order_acq_rel);
    if ((s & STATE_INSIDE) != 0 && !spin_until(done_posted, 0)) sem_wait_through_signals(&crew.done);
    pthread_mutex_unlock(&crew.submit);
}
