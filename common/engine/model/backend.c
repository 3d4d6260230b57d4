// SPDX-License-Identifier: Apache-2.0
// backend registry: maps a backend name ("cpu", "cuda", "cuda-emu") to its
// ops table. The CPU backend is built in; a device backend is a module loaded
// at run time (backend_module.h), so nothing here, nor anywhere in the model
// code, depends on how the binary was configured. The CUDA module's device KV
// transfer table is handed out here too (tdm_backend_module_kvx), so the
// transfer code (common/engine/kvx) needs no module loader.
#include <dlfcn.h>
#include <limits.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "backend.h"
#include "backend_module.h"
#include "core.h"

// Backends added at run time (tdm_backend_register), searched after the CPU one.
#define MAX_REGISTERED 4
static const struct tdm_backend_ops *registered[MAX_REGISTERED];
static int num_registered;

// ---- modules ----------------------------------------------------------------------------------
#define MAX_MODULES 8
#define MODULE_ERR 1024
static struct loaded_module {
    char name[32];
    int rc;
    const struct tdm_backend_module *mod;
    char err[MODULE_ERR];
} modules[MAX_MODULES];
static int num_modules;
static pthread_mutex_t modules_mu = PTHREAD_MUTEX_INITIALIZER;

// A module name is what --device takes before ':': lower-case letters,
// digits and '-', so it can never name a path.
static bool module_name_ok(const char *name)
{
    size_t n = strlen(name);
    if (n == 0 || n >= sizeof modules[0].name)
        return false;
    for (size_t i = 0; i < n; i++) {
        char c = name[i];
        if (!((c >= 'a' && c <= 'z') || (c >= '0' && c <= '9') || c == '-'))
            return false;
    }
    return true;
}

// Folders to look in, in order (backend_module.h), each written into
// dirs[i] (at most `max`); returns how many.
static int module_dirs(char dirs[][PATH_MAX], int max)
{
    if (max > 8)
        max = 8;
    int n = 0;
    const char *env = getenv("TANDEM_BACKEND_PATH");
    if (env != NULL && env[0] != '\0') {
        const char *p = env;
        while (*p && n < max) {
            const char *e = strchr(p, ':');
            size_t len = e ? (size_t)(e - p) : strlen(p);
            if (len > 0 && len < PATH_MAX) {
                memcpy(dirs[n], p, len);
                dirs[n++][len] = '\0';
            }
            p += len + (e ? 1 : 0);
        }
        return n;
    }
    char exe[PATH_MAX - 16]; // room for "/../lib" in dirs[]
    ssize_t len = readlink("/proc/self/exe", exe, sizeof exe - 1);
    if (len > 0) {
        exe[len] = '\0';
        char *slash = strrchr(exe, '/');
        if (slash != NULL) {
            *slash = '\0';
            if (n < max)
                snprintf(dirs[n++], PATH_MAX, "%s", exe[0] ? exe : "/");
            if (n < max)
                snprintf(dirs[n++], PATH_MAX, "%s/../lib", exe);
        }
    }
#ifdef TDM_BUILD_MODULE_DIR
    if (n < max)
        snprintf(dirs[n++], PATH_MAX, "%s", TDM_BUILD_MODULE_DIR);
#endif
    // The same folder twice (a binary one level below the build's root) once.
    char real[8][PATH_MAX];
    int kept = 0;
    for (int i = 0; i < n; i++) {
        if (realpath(dirs[i], real[kept]) == NULL)
            memcpy(real[kept], dirs[i], PATH_MAX);
        bool dup = false;
        for (int j = 0; j < kept && !dup; j++)
            dup = strcmp(real[j], real[kept]) == 0;
        if (!dup) {
            if (kept != i)
                memcpy(dirs[kept], dirs[i], PATH_MAX);
            kept++;
        }
    }
    return kept;
}

static int module_open(struct loaded_module *lm)
{
    const char *name = lm->name;
    char file[64];
    snprintf(file, sizeof file, "libtandem-%s.so", name);
    char dirs[8][PATH_MAX];
    int nd = module_dirs(dirs, 8);
    bool env_set = getenv("TANDEM_BACKEND_PATH") && getenv("TANDEM_BACKEND_PATH")[0];
    char path[PATH_MAX + 64];
    void *h = NULL;
    for (int i = 0; i < nd && h == NULL; i++) {
        snprintf(path, sizeof path, "%s/%s", dirs[i], file);
        if (access(path, F_OK) != 0)
            continue;
        h = dlopen(path, RTLD_NOW | RTLD_LOCAL);
        if (h == NULL) {
            const char *why = dlerror();
            return tdm_seterr(lm->err, sizeof lm->err, TDM_EBACKEND, "cannot load %s: %s", path,
                              why ? why : "unknown error");
        }
    }
    if (h == NULL && !env_set) { // the dynamic linker's own search
        snprintf(path, sizeof path, "%s", file);
        h = dlopen(file, RTLD_NOW | RTLD_LOCAL);
        if (h == NULL) {
            const char *why = dlerror();
            // Found but unloadable (a library it needs is missing): say so.
            if (why != NULL && strstr(why, file) == NULL)
                return tdm_seterr(lm->err, sizeof lm->err, TDM_EBACKEND, "cannot load %s: %s", file,
                                  why);
        }
    }
    if (h == NULL) {
        char where[1024] = "";
        size_t off = 0;
        for (int i = 0; i < nd && off < sizeof where; i++)
            off +=
                (size_t)snprintf(where + off, sizeof where - off, "%s%s", i ? ", " : "", dirs[i]);
        return tdm_seterr(lm->err, sizeof lm->err, TDM_ENOTFOUND,
                          "%s not found (looked in %s%s; TANDEM_BACKEND_PATH names its folder)",
                          file, nd ? where : "no folder",
                          env_set ? "" : " and the dynamic linker's path");
    }
    void *sym = dlsym(h, TDM_BACKEND_MODULE_INIT_SYMBOL);
    if (sym == NULL) {
        dlclose(h);
        return tdm_seterr(lm->err, sizeof lm->err, TDM_EBACKEND,
                          "%s is not a Tandem backend module (no %s)", path,
                          TDM_BACKEND_MODULE_INIT_SYMBOL);
    }
    tdm_backend_module_init_fn init;
    memcpy(&init, &sym, sizeof init); // object pointer to function pointer (POSIX dlsym)
    struct tdm_backend_host host = {
        .api = TDM_BACKEND_MODULE_API,
        .backend_ops_bytes = (uint32_t)sizeof(struct tdm_backend_ops),
        .log = tdm_log_emit,
    };
    char why[512] = "";
    const struct tdm_backend_module *m = init(&host, why, sizeof why);
    if (m == NULL) {
        dlclose(h);
        return tdm_seterr(lm->err, sizeof lm->err, TDM_EBACKEND, "%s refused to load: %s", path,
                          why[0] ? why : "no reason given");
    }
    if (m->api != TDM_BACKEND_MODULE_API || m->backend == NULL || m->name == NULL) {
        // Not dlclosed: a module of another version may have started threads.
        if (m->api != TDM_BACKEND_MODULE_API)
            return tdm_seterr(lm->err, sizeof lm->err, TDM_EBACKEND,
                              "%s is backend module API %u, this binary needs %d (install the "
                              "module built with this binary)",
                              path, m->api, TDM_BACKEND_MODULE_API);
        return tdm_seterr(lm->err, sizeof lm->err, TDM_EBACKEND, "%s registered no backend", path);
    }
    lm->mod = m; // the handle stays open for the process's life
    TDM_LOG_INFO("backend", "loaded backend module %s (%s)", path, m->summary ? m->summary : "");
    return TDM_OK;
}

int tdm_backend_module_load(const char *name, const struct tdm_backend_module **out, char *err,
                            size_t errlen)
{
    *out = NULL;
    if (name == NULL || !module_name_ok(name))
        return tdm_seterr(err, errlen, TDM_EINVAL, "'%s' is not a backend module name",
                          name ? name : "");
    pthread_mutex_lock(&modules_mu);
    struct loaded_module *lm = NULL;
    for (int i = 0; i < num_modules; i++)
        if (strcmp(modules[i].name, name) == 0)
            lm = &modules[i];
    if (lm == NULL) {
        if (num_modules == MAX_MODULES) {
            pthread_mutex_unlock(&modules_mu);
            return tdm_seterr(err, errlen, TDM_ECAPACITY, "too many backend modules");
        }
        lm = &modules[num_modules++];
        snprintf(lm->name, sizeof lm->name, "%s", name);
        lm->rc = module_open(lm);
    }
    int rc = lm->rc;
    if (rc == TDM_OK)
        *out = lm->mod;
    else
        tdm_seterr(err, errlen, rc, "%s", lm->err);
    pthread_mutex_unlock(&modules_mu);
    return rc;
}

int tdm_backend_module_kvx(const struct tdm_kvx_ops **out, char *err, size_t errlen)
{
    const struct tdm_backend_module *m;
    *out = NULL;
    int rc = tdm_backend_module_load("cuda", &m, err, errlen);
    if (rc == TDM_OK)
        *out = m->kvx;
    return rc;
}

// ---- the registry -----------------------------------------------------------------------------
int tdm_backend_lookup(const char *name, const struct tdm_backend_ops **out, char *err,
                       size_t errlen)
{
    if (name == NULL || name[0] == '\0')
        name = "cpu";
    *out = NULL;
    if (strcmp(name, "cpu") == 0) {
        *out = &tdm_cpu_backend_ops;
        return TDM_OK;
    }
    for (int i = 0; i < num_registered; i++)
        if (strcmp(registered[i]->name, name) == 0) {
            *out = registered[i];
            return TDM_OK;
        }
    const struct tdm_backend_module *m;
    int rc = tdm_backend_module_load(name, &m, err, errlen);
    if (rc == TDM_OK)
        *out = m->backend;
    return rc;
}

const struct tdm_backend_ops *tdm_backend_find(const char *name)
{
    const struct tdm_backend_ops *ops;
    return tdm_backend_lookup(name, &ops, NULL, 0) == TDM_OK ? ops : NULL;
}

int tdm_backend_register(const struct tdm_backend_ops *ops)
{
    if (ops == NULL || ops->name == NULL)
        return TDM_EINVAL;
    if (num_registered == MAX_REGISTERED)
        return TDM_ECAPACITY;
    registered[num_registered++] = ops;
    return TDM_OK;
}
