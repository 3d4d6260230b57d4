// SPDX-License-Identifier: Apache-2.0
// chat_builtins: what a chat template can call. Jinja2's filters and tests that HF
// templates use (with HF's own tojson: Python json.dumps, ensure_ascii=False),
// the globals HF's apply_chat_template defines (raise_exception, strftime_now)
// plus Jinja's namespace/range/dict, the Python str/dict methods templates call
// (startswith, split, strip, get, items...), and attribute and item lookup in the
// order Jinja's sandbox does it (a dict's methods shadow its keys for `.name`).
// A filter or test name not in these tables is refused when the template loads;
// a method that exists in Python but is not implemented here fails the render
// with its name, never a silent wrong result. Case mapping uses the C library's
// Unicode simple case tables (plus Python's sharp-s rule), not Python's full
// SpecialCasing: a handful of characters (e.g. U+0130, ligatures) differ.
#include <locale.h>
#include <math.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <wctype.h>

#include "chat_impl.h"
#include "core.h"

// ---- helpers -------------------------------------------------------------------------

static int oom_cap(struct render *r)
{
    return chat_rerr(r, TDM_ECAPACITY, "rendering needs more than %u MiB of values (limit)",
                     CHAT_MAX_ARENA >> 20);
}

// Finds an argument by position (before any keyword) or by keyword name.
static bool arg(const struct val *args, const char *const *names, size_t nargs, size_t pos,
                const char *name, struct val *out)
{
    size_t p = 0;
    for (size_t i = 0; i < nargs; i++) {
        if (names && names[i]) {
            if (name && strcmp(names[i], name) == 0) {
                *out = args[i];
                return true;
            }
        } else if (p++ == pos) {
            *out = args[i];
            return true;
        }
    }
    return false;
}

static size_t npositional(const char *const *names, size_t nargs)
{
    size_t p = 0;
    for (size_t i = 0; i < nargs; i++)
        if (!names || !names[i])
            p++;
    return p;
}

static const char *find_bytes(const char *h, size_t hn, const char *n, size_t nn)
{
    if (nn == 0)
        return h;
    return memmem(h, hn, n, nn); // glibc's two-way search (the build defines _GNU_SOURCE)
}

static int need_str(struct render *r, struct val v, const char *what)
{
    if (v.kind == V_STR)
        return TDM_OK;
    if (v.kind == V_UNDEF)
        return chat_rerr(r, TDM_EINVAL, "'%s' is undefined",
                         v.u.undef_name ? v.u.undef_name : "value");
    return chat_rerr(r, TDM_EINVAL, "%s: expected a string, got %s", what, chat_v_type_name(v));
}

static int need_int(struct render *r, struct val v, const char *what, int64_t *out)
{
    if (v.kind == V_INT || v.kind == V_BOOL) {
        *out = v.kind == V_INT ? v.u.i : v.u.b;
        return TDM_OK;
    }
    return chat_rerr(r, TDM_EINVAL, "%s: expected an integer, got %s", what, chat_v_type_name(v));
}

static char ascii_upper(char c)
{
    return c >= 'a' && c <= 'z' ? (char)(c - 32) : c;
}

static char ascii_lower(char c)
{
    return c >= 'A' && c <= 'Z' ? (char)(c + 32) : c;
}

static bool ascii_alpha(char c)
{
    return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z');
}

// Strip from both/left/right ends: Unicode whitespace, or the code points in chars.
static int do_strip(struct render *r, struct val s, struct val chars, bool left, bool right,
                    struct val *out)
{
    const char *p = s.u.str.s;
    size_t n = s.u.str.n, start = 0, end = n;
    bool use_chars = chars.kind == V_STR;
    if (!use_chars && chars.kind != V_NONE && chars.kind != V_UNDEF)
        return chat_rerr(r, TDM_EINVAL, "strip arg must be None or str");
    if (!chat_charge(r, n / 2))
        return r->rc;
    // Walk code points, remembering the first and last kept.
    size_t first_keep = n, last_keep_end = 0;
    for (size_t i = 0; i < n;) {
        uint32_t cp;
        size_t len = tdm_utf8_next(p, n, i, &cp);
        bool strip;
        if (use_chars) {
            strip = false;
            for (size_t j = 0; j < chars.u.str.n;) {
                uint32_t c2;
                size_t l2 = tdm_utf8_next(chars.u.str.s, chars.u.str.n, j, &c2);
                if (c2 == cp && l2 == len && memcmp(chars.u.str.s + j, p + i, len) == 0)
                    strip = true;
                j += l2;
            }
        } else {
            strip = chat_py_isspace(cp);
        }
        if (!strip) {
            if (first_keep == n)
                first_keep = i;
            last_keep_end = i + len;
        }
        i += len;
    }
    if (first_keep == n) { // all stripped
        start = left ? n : 0;
        end = right ? start : n;
        if (!left && right)
            end = 0, start = 0;
    } else {
        if (left)
            start = first_keep;
        if (right)
            end = last_keep_end;
    }
    *out = chat_v_strn(p + start, end > start ? end - start : 0);
    out->markup = s.markup;
    return TDM_OK;
}

// Unicode simple case mapping from the C library's C.UTF-8 tables (a locale object
// made once, never installed, so nothing global changes); ASCII when unavailable.
static locale_t case_locale;
static pthread_once_t case_once = PTHREAD_ONCE_INIT;

static void case_locale_init(void)
{
    case_locale = newlocale(LC_CTYPE_MASK, "C.UTF-8", (locale_t)0);
}

static uint32_t cp_case(uint32_t cp, bool upper)
{
    if (cp < 0x80)
        return (uint32_t)(upper ? ascii_upper((char)cp) : ascii_lower((char)cp));
    pthread_once(&case_once, case_locale_init);
    if (!case_locale)
        return cp;
    return (uint32_t)(upper ? towupper_l((wint_t)cp, case_locale)
                            : towlower_l((wint_t)cp, case_locale));
}

static bool cp_cased(uint32_t cp)
{
    return cp_case(cp, true) != cp || cp_case(cp, false) != cp;
}

// Appends cp upper- or lower-cased; Python maps U+00DF (sharp s) to "SS" in upper().
static void put_case(struct tdm_strbuf *b, uint32_t cp, bool upper, bool title)
{
    if (cp == 0xDF && upper) {
        tdm_strbuf_adds(b, title ? "Ss" : "SS");
        return;
    }
    chat_utf8_put(b, cp_case(cp, upper));
}

static int map_case(struct render *r, struct val s, int mode, struct val *out)
{
    // mode 0 upper, 1 lower, 2 capitalize, 3 str.title, 4 swapcase
    struct tdm_strbuf b = {.limit = CHAT_MAX_STRING};
    bool prev_cased = false;
    size_t k = 0;
    for (size_t i = 0; i < s.u.str.n; k++) {
        uint32_t cp;
        size_t len = tdm_utf8_next(s.u.str.s, s.u.str.n, i, &cp);
        if (cp == 0xFFFD && len == 1 && (unsigned char)s.u.str.s[i] >= 0x80) {
            tdm_strbuf_add(&b, s.u.str.s + i, 1); // invalid UTF-8: kept as it is
            i += len;
            continue;
        }
        switch (mode) {
        case 0:
            put_case(&b, cp, true, false);
            break;
        case 1:
            put_case(&b, cp, false, false);
            break;
        case 2:
            put_case(&b, cp, k == 0, k == 0);
            break;
        case 3:
            put_case(&b, cp, !prev_cased, !prev_cased);
            prev_cased = cp_cased(cp);
            break;
        default:
            put_case(&b, cp, cp_case(cp, false) == cp, false);
        }
        i += len;
    }
    int rc = chat_sb_to_val(r, &b, out);
    free(b.p);
    if (rc == TDM_OK && !chat_charge(r, s.u.str.n / 2))
        return r->rc;
    return rc;
}

static int do_replace(struct render *r, struct val s, struct val old, struct val new_,
                      int64_t count, struct val *out)
{
    if (need_str(r, old, "replace") != TDM_OK || need_str(r, new_, "replace") != TDM_OK)
        return r->rc;
    struct tdm_strbuf b = {.limit = CHAT_MAX_STRING};
    const char *p = s.u.str.s, *end = s.u.str.s + s.u.str.n;
    int64_t done = 0;
    if (old.u.str.n == 0) { // Python inserts between every character
        uint32_t cp;
        size_t i = 0;
        while (true) {
            if (count < 0 || done < count) {
                tdm_strbuf_add(&b, new_.u.str.s, new_.u.str.n);
                done++;
            }
            if (i >= s.u.str.n)
                break;
            size_t len = tdm_utf8_next(s.u.str.s, s.u.str.n, i, &cp);
            tdm_strbuf_add(&b, s.u.str.s + i, len);
            i += len;
        }
    } else {
        while (p < end && (count < 0 || done < count)) {
            const char *hit = find_bytes(p, (size_t)(end - p), old.u.str.s, old.u.str.n);
            if (!hit)
                break;
            tdm_strbuf_add(&b, p, (size_t)(hit - p));
            tdm_strbuf_add(&b, new_.u.str.s, new_.u.str.n);
            p = hit + old.u.str.n;
            done++;
        }
        tdm_strbuf_add(&b, p, (size_t)(end - p));
    }
    if (!chat_charge(r, s.u.str.n / 2))
        return r->rc;
    int rc = chat_sb_to_val(r, &b, out);
    free(b.p);
    return rc;
}

static int push_str(struct render *r, struct vlist *l, const char *s, size_t n)
{
    return chat_v_list_push(r, l, chat_v_strn(s, n));
}

// str.split / str.rsplit (sep NULL: runs of whitespace).
static int do_split(struct render *r, struct val s, struct val sep, int64_t maxsplit, bool rev,
                    struct val *out)
{
    if (chat_v_list_new(r, 0, out) != TDM_OK)
        return r->rc;
    struct vlist *l = out->u.list;
    const char *p = s.u.str.s;
    size_t n = s.u.str.n;
    if (!chat_charge(r, n / 2))
        return r->rc;
    if (sep.kind == V_STR) {
        if (sep.u.str.n == 0)
            return chat_rerr(r, TDM_EINVAL, "empty separator");
        if (!rev) {
            size_t i = 0;
            int64_t splits = 0;
            while (maxsplit < 0 || splits < maxsplit) {
                const char *hit = find_bytes(p + i, n - i, sep.u.str.s, sep.u.str.n);
                if (!hit)
                    break;
                if (push_str(r, l, p + i, (size_t)(hit - (p + i))) != TDM_OK)
                    return r->rc;
                i = (size_t)(hit - p) + sep.u.str.n;
                splits++;
            }
            return push_str(r, l, p + i, n - i);
        }
        // rsplit: collect from the right, then reverse.
        size_t end = n;
        int64_t splits = 0;
        while (maxsplit < 0 || splits < maxsplit) {
            size_t found = SIZE_MAX;
            for (size_t j = end; j >= sep.u.str.n; j--) {
                if (memcmp(p + j - sep.u.str.n, sep.u.str.s, sep.u.str.n) == 0) {
                    found = j - sep.u.str.n;
                    break;
                }
            }
            if (found == SIZE_MAX)
                break;
            if (push_str(r, l, p + found + sep.u.str.n, end - found - sep.u.str.n) != TDM_OK)
                return r->rc;
            end = found;
            splits++;
        }
        if (push_str(r, l, p, end) != TDM_OK)
            return r->rc;
        for (size_t a = 0, b = l->n - 1; a < b; a++, b--) {
            struct val t = l->items[a];
            l->items[a] = l->items[b];
            l->items[b] = t;
        }
        return TDM_OK;
    }
    if (sep.kind != V_NONE && sep.kind != V_UNDEF)
        return chat_rerr(r, TDM_EINVAL, "must be str or None, not %s", chat_v_type_name(sep));
    if (rev && maxsplit >= 0)
        return chat_rerr(r, TDM_EINVAL, "rsplit() with maxsplit and no separator is not supported");
    // Whitespace split.
    size_t i = 0;
    int64_t splits = 0;
    while (i < n) {
        uint32_t cp;
        size_t len = tdm_utf8_next(p, n, i, &cp);
        if (chat_py_isspace(cp)) {
            i += len;
            continue;
        }
        size_t start = i;
        if (maxsplit >= 0 && splits >= maxsplit) {
            // the rest, right-stripped
            size_t end = n;
            while (end > start) {
                size_t k = end - 1;
                while (k > start && ((unsigned char)p[k] & 0xC0) == 0x80)
                    k--;
                tdm_utf8_next(p, n, k, &cp);
                if (!chat_py_isspace(cp))
                    break;
                end = k;
            }
            return push_str(r, l, p + start, end - start);
        }
        while (i < n) {
            len = tdm_utf8_next(p, n, i, &cp);
            if (chat_py_isspace(cp))
                break;
            i += len;
        }
        if (push_str(r, l, p + start, i - start) != TDM_OK)
            return r->rc;
        splits++;
    }
    return TDM_OK;
}

// Python str.splitlines() line boundaries.
static size_t line_break_len(const char *p, size_t n, size_t i)
{
    uint32_t cp;
    size_t len = tdm_utf8_next(p, n, i, &cp);
    if (cp == '\r' && i + 1 < n && p[i + 1] == '\n')
        return 2;
    if (cp == '\n' || cp == '\r' || cp == 0x0B || cp == 0x0C || cp == 0x1C || cp == 0x1D ||
        cp == 0x1E || cp == 0x85 || cp == 0x2028 || cp == 0x2029)
        return len;
    return 0;
}

static int do_splitlines(struct render *r, struct val s, bool keepends, struct val *out)
{
    if (chat_v_list_new(r, 0, out) != TDM_OK)
        return r->rc;
    const char *p = s.u.str.s;
    size_t n = s.u.str.n, start = 0, i = 0;
    while (i < n) {
        size_t bl = line_break_len(p, n, i);
        if (bl) {
            if (push_str(r, out->u.list, p + start, i - start + (keepends ? bl : 0)) != TDM_OK)
                return r->rc;
            i += bl;
            start = i;
        } else {
            uint32_t cp;
            i += tdm_utf8_next(p, n, i, &cp);
        }
    }
    if (start < n)
        return push_str(r, out->u.list, p + start, n - start);
    return TDM_OK;
}

// ---- iteration and lookup --------------------------------------------------------------

int chat_v_iterate(struct render *r, struct val v, struct val *out)
{
    switch (v.kind) {
    case V_LIST:
        if (v.u.list->gen && v.u.list->consumed) // a Python generator runs once
            return chat_v_list_new(r, 0, out);
        if (v.u.list->gen)
            v.u.list->consumed = true;
        *out = v;
        return TDM_OK;
    case V_DICT:
        if (chat_v_list_new(r, v.u.dict->n, out) != TDM_OK)
            return r->rc;
        for (size_t i = 0; i < v.u.dict->n; i++)
            chat_v_list_push(r, out->u.list, v.u.dict->keys[i]);
        return r->rc;
    case V_STR: {
        if (chat_v_list_new(r, 0, out) != TDM_OK)
            return r->rc;
        uint32_t cp;
        for (size_t i = 0; i < v.u.str.n;) {
            size_t len = tdm_utf8_next(v.u.str.s, v.u.str.n, i, &cp);
            if (push_str(r, out->u.list, v.u.str.s + i, len) != TDM_OK)
                return r->rc;
            i += len;
        }
        return TDM_OK;
    }
    case V_UNDEF:
        return chat_v_list_new(r, 0, out);
    default:
        return chat_rerr(r, TDM_EINVAL, "'%s' object is not iterable", chat_v_type_name(v));
    }
}

static const char *const str_methods[] = {
    "capitalize",   "casefold",    "center",    "count",      "encode",       "endswith",
    "expandtabs",   "find",        "format",    "format_map", "index",        "isalnum",
    "isalpha",      "isascii",     "isdecimal", "isdigit",    "isidentifier", "islower",
    "isnumeric",    "isprintable", "isspace",   "istitle",    "isupper",      "join",
    "ljust",        "lower",       "lstrip",    "maketrans",  "partition",    "removeprefix",
    "removesuffix", "replace",     "rfind",     "rindex",     "rjust",        "rpartition",
    "rsplit",       "rstrip",      "split",     "splitlines", "startswith",   "strip",
    "swapcase",     "title",       "translate", "upper",      "zfill",        NULL};
static const char *const dict_methods[] = {"clear",      "copy",   "fromkeys", "get",
                                           "items",      "keys",   "pop",      "popitem",
                                           "setdefault", "update", "values",   NULL};
static const char *const list_methods[] = {"append", "clear",   "copy",   "count",
                                           "extend", "index",   "insert", "pop",
                                           "remove", "reverse", "sort",   NULL};

static const char *method_name(const char *const *table, const char *name, size_t n)
{
    for (size_t i = 0; table[i]; i++)
        if (strlen(table[i]) == n && memcmp(table[i], name, n) == 0)
            return table[i];
    return NULL;
}

static int bind_method(struct render *r, struct val self, const char *name, struct val *out)
{
    struct val *s = chat_arena_alloc(&r->arena, sizeof *s);
    if (!s)
        return oom_cap(r);
    *s = self;
    *out = (struct val){.kind = V_METHOD, .u.method = {s, name}};
    return TDM_OK;
}

static char *cstr(struct render *r, const char *s, size_t n)
{
    return chat_arena_strndup(&r->arena, s, n);
}

int chat_get_attr(struct render *r, struct val obj, const char *name, size_t n, struct val *out)
{
    const char *m;
    switch (obj.kind) {
    case V_UNDEF:
        return chat_rerr(r, TDM_EINVAL, "'%s' is undefined (reading .%.*s)",
                         obj.u.undef_name ? obj.u.undef_name : "value", (int)n, name);
    case V_DICT:
        if ((m = method_name(dict_methods, name, n)))
            return bind_method(r, obj, m, out);
        if (chat_v_dict_get(obj.u.dict, name, n, out))
            return TDM_OK;
        break;
    case V_NS:
        if (chat_v_dict_get(obj.u.dict, name, n, out))
            return TDM_OK;
        break;
    case V_STR:
        if ((m = method_name(str_methods, name, n)))
            return bind_method(r, obj, m, out);
        break;
    case V_LIST:
        if ((m = method_name(list_methods, name, n)))
            return bind_method(r, obj, m, out);
        break;
    case V_LOOP: {
        struct loopinfo *li = obj.u.loop;
#define IS(s) (n == strlen(s) && memcmp(name, s, n) == 0)
        if (IS("index0"))
            *out = chat_v_int(li->index0);
        else if (IS("index"))
            *out = chat_v_int(li->index0 + 1);
        else if (IS("revindex"))
            *out = chat_v_int(li->length - li->index0);
        else if (IS("revindex0"))
            *out = chat_v_int(li->length - li->index0 - 1);
        else if (IS("first"))
            *out = chat_v_bool(li->index0 == 0);
        else if (IS("last"))
            *out = chat_v_bool(li->index0 == li->length - 1);
        else if (IS("length"))
            *out = chat_v_int(li->length);
        else if (IS("previtem"))
            *out = li->prev;
        else if (IS("nextitem"))
            *out = li->next;
        else if (IS("depth"))
            *out = chat_v_int(1);
        else if (IS("depth0"))
            *out = chat_v_int(0);
        else if (IS("cycle"))
            return bind_method(r, obj, "cycle", out);
        else
            break;
#undef IS
        return TDM_OK;
    }
    default:
        break;
    }
    *out = chat_v_undef(cstr(r, name, n));
    return TDM_OK;
}

int chat_get_item(struct render *r, struct val obj, struct val key, struct val *out)
{
    switch (obj.kind) {
    case V_UNDEF:
        return chat_rerr(r, TDM_EINVAL, "'%s' is undefined (reading an item)",
                         obj.u.undef_name ? obj.u.undef_name : "value");
    case V_DICT:
        if (chat_v_dict_find(obj.u.dict, key, out))
            return TDM_OK;
        break;
    case V_LIST:
        if (obj.u.list->gen || obj.u.list->view)
            break;
        // fall through
    case V_STR:
        if (key.kind == V_INT || key.kind == V_BOOL) {
            int64_t i = key.kind == V_INT ? key.u.i : key.u.b;
            if (obj.kind == V_LIST) {
                int64_t n = (int64_t)obj.u.list->n;
                if (i < 0)
                    i += n;
                if (i >= 0 && i < n) {
                    *out = obj.u.list->items[i];
                    return TDM_OK;
                }
            } else {
                int64_t n = (int64_t)chat_utf8_len(obj.u.str.s, obj.u.str.n);
                if (i < 0)
                    i += n;
                if (i >= 0 && i < n) {
                    size_t off = 0;
                    uint32_t cp;
                    for (int64_t k = 0; k < i; k++)
                        off += tdm_utf8_next(obj.u.str.s, obj.u.str.n, off, &cp);
                    size_t len = tdm_utf8_next(obj.u.str.s, obj.u.str.n, off, &cp);
                    *out = chat_v_strn(obj.u.str.s + off, len);
                    return TDM_OK;
                }
            }
            *out = chat_v_undef("index out of range");
            return TDM_OK;
        }
        break;
    default:
        break;
    }
    if (key.kind == V_STR)
        return chat_get_attr(r, obj.kind == V_DICT ? chat_v_none() : obj, key.u.str.s, key.u.str.n,
                             out);
    *out = chat_v_undef(NULL);
    return TDM_OK;
}

// Jinja's make_attrgetter: "a.b.0" looks up each part with getitem.
static int attr_path(struct render *r, struct val item, struct val attr, struct val *out)
{
    if (attr.kind == V_INT)
        return chat_get_item(r, item, attr, out);
    if (need_str(r, attr, "attribute") != TDM_OK)
        return r->rc;
    const char *p = attr.u.str.s, *end = p + attr.u.str.n;
    struct val cur = item;
    while (true) {
        const char *dot = memchr(p, '.', (size_t)(end - p));
        const char *seg_end = dot ? dot : end;
        struct val key = chat_v_strn(p, (size_t)(seg_end - p));
        bool digits = seg_end > p;
        for (const char *q = p; q < seg_end; q++)
            digits &= *q >= '0' && *q <= '9';
        if (digits)
            key = chat_v_int(strtoll(p, NULL, 10));
        if (cur.kind == V_UNDEF) {
            *out = cur;
            return TDM_OK;
        }
        if (chat_get_item(r, cur, key, &cur) != TDM_OK)
            return r->rc;
        if (!dot)
            break;
        p = dot + 1;
    }
    *out = cur;
    return TDM_OK;
}

// ---- filters -------------------------------------------------------------------------

enum {
    F_ABS,
    F_ATTR,
    F_CAPITALIZE,
    F_COUNT,
    F_D,
    F_DEFAULT,
    F_DICTSORT,
    F_E,
    F_ESCAPE,
    F_FIRST,
    F_FLOAT,
    F_FORCEESCAPE,
    F_INDENT,
    F_INT,
    F_ITEMS,
    F_JOIN,
    F_LAST,
    F_LENGTH,
    F_LIST,
    F_LOWER,
    F_MAP,
    F_MAX,
    F_MIN,
    F_REJECT,
    F_REJECTATTR,
    F_REPLACE,
    F_REVERSE,
    F_ROUND,
    F_SAFE,
    F_SELECT,
    F_SELECTATTR,
    F_SORT,
    F_STRING,
    F_SUM,
    F_TITLE,
    F_TOJSON,
    F_TRIM,
    F_UNIQUE,
    F_UPPER,
    F_WORDCOUNT,
    F_COUNT_ALL
};

// ---- tests ---------------------------------------------------------------------------

enum {
    T_BOOLEAN,
    T_CALLABLE,
    T_DEFINED,
    T_DIVISIBLEBY,
    T_EQ,
    T_EQUALTO,
    T_ESCAPED,
    T_EVEN,
    T_FALSE,
    T_FLOAT_,
    T_GE,
    T_GT,
    T_GREATERTHAN,
    T_IN,
    T_INTEGER,
    T_ITERABLE,
    T_LE,
    T_LESSTHAN,
    T_LOWER,
    T_LT,
    T_MAPPING,
    T_NE,
    T_NONE,
    T_NUMBER,
    T_ODD,
    T_SAMEAS,
    T_SEQUENCE,
    T_STRING_,
    T_TRUE,
    T_UNDEFINED,
    T_UPPER,
    T_COUNT_ALL
};

// A test on v, with a its argument (undefined for the tests that take none); idx tells apart
// the tests sharing a function. Sets *out; returns TDM_OK or r->rc after an error.
typedef int (*test_fn)(struct render *r, int idx, struct val v, struct val a, bool *out);

// The tests that look only at v's kind (and a bool's value).
static int t_kind(struct render *r, int idx, struct val v, struct val a, bool *out)
{
    (void)a;
    switch (idx) {
    case T_BOOLEAN:
        *out = v.kind == V_BOOL;
        return TDM_OK;
    case T_CALLABLE:
        *out = v.kind == V_MACRO || v.kind == V_FUNC || v.kind == V_METHOD;
        return TDM_OK;
    case T_DEFINED:
        *out = v.kind != V_UNDEF;
        return TDM_OK;
    case T_UNDEFINED:
        *out = v.kind == V_UNDEF;
        return TDM_OK;
    case T_ESCAPED:
        *out = v.kind == V_STR && v.markup;
        return TDM_OK;
    case T_FALSE:
        *out = v.kind == V_BOOL && !v.u.b;
        return TDM_OK;
    case T_TRUE:
        *out = v.kind == V_BOOL && v.u.b;
        return TDM_OK;
    case T_FLOAT_:
        *out = v.kind == V_FLOAT;
        return TDM_OK;
    case T_INTEGER:
        *out = v.kind == V_INT;
        return TDM_OK;
    case T_NUMBER:
        *out = v.kind == V_INT || v.kind == V_FLOAT || v.kind == V_BOOL;
        return TDM_OK;
    case T_ITERABLE:
        *out = v.kind == V_LIST || v.kind == V_DICT || v.kind == V_STR || v.kind == V_UNDEF ||
               v.kind == V_LOOP;
        return TDM_OK;
    case T_SEQUENCE:
        *out = (v.kind == V_LIST && !v.u.list->gen && !v.u.list->view) || v.kind == V_DICT ||
               v.kind == V_STR || v.kind == V_UNDEF;
        return TDM_OK;
    case T_MAPPING:
        *out = v.kind == V_DICT;
        return TDM_OK;
    case T_NONE:
        *out = v.kind == V_NONE;
        return TDM_OK;
    case T_STRING_:
        *out = v.kind == V_STR;
        return TDM_OK;
    }
    return chat_rerr(r, TDM_EINVAL, "internal: unknown test %d", idx);
}

// eq/equalto(a), ne(a), and sameas(a): equal and, for a container, the same object.
static int t_equal(struct render *r, int idx, struct val v, struct val a, bool *out)
{
    (void)r;
    if (idx == T_NE)
        *out = !chat_v_equal(v, a);
    else if (idx == T_SAMEAS)
        *out = v.kind == a.kind && chat_v_equal(v, a) &&
               (v.kind == V_NONE || v.kind == V_BOOL || v.kind == V_UNDEF ||
                (v.kind == V_LIST && v.u.list == a.u.list) ||
                (v.kind == V_DICT && v.u.dict == a.u.dict) || v.kind == V_INT);
    else
        *out = chat_v_equal(v, a);
    return TDM_OK;
}

// ge, gt/greaterthan, le, lt/lessthan (a).
static int t_order(struct render *r, int idx, struct val v, struct val a, bool *out)
{
    int cmp;
    if (chat_v_compare(r, v, a, &cmp) != TDM_OK)
        return r->rc;
    *out = idx == T_GE                             ? cmp >= 0
           : idx == T_LE                           ? cmp <= 0
           : (idx == T_GT || idx == T_GREATERTHAN) ? cmp > 0
                                                   : cmp < 0;
    return TDM_OK;
}

// in(a): v is in the container a.
static int t_in(struct render *r, int idx, struct val v, struct val a, bool *out)
{
    (void)idx;
    return chat_v_contains(r, a, v, out);
}

// lower, upper: v's string has cased letters, all of that case.
static int t_case(struct render *r, int idx, struct val v, struct val a, bool *out)
{
    (void)a;
    if (v.kind != V_STR) {
        struct val s;
        if (chat_v_stringify(r, v, &s) != TDM_OK)
            return r->rc;
        v = s;
    }
    bool cased = false, ok = true;
    for (size_t i = 0; i < v.u.str.n; i++) {
        char c = v.u.str.s[i];
        if (ascii_alpha(c)) {
            cased = true;
            if (idx == T_LOWER ? (c >= 'A' && c <= 'Z') : (c >= 'a' && c <= 'z'))
                ok = false;
        }
    }
    *out = cased && ok;
    return TDM_OK;
}

// divisibleby(a), even, odd: integers only. Defined after the table, whose names its
// messages use.
static int t_divisible(struct render *r, int idx, struct val v, struct val a, bool *out);

// The tests: name, function, and whether it takes its one argument (the rest take none).
static const struct test {
    const char *name;
    test_fn fn;
    bool binary;
} tests[T_COUNT_ALL] = {
    [T_BOOLEAN] = {.name = "boolean", .fn = t_kind},
    [T_CALLABLE] = {.name = "callable", .fn = t_kind},
    [T_DEFINED] = {.name = "defined", .fn = t_kind},
    [T_DIVISIBLEBY] = {.name = "divisibleby", .fn = t_divisible, .binary = true},
    [T_EQ] = {.name = "eq", .fn = t_equal, .binary = true},
    [T_EQUALTO] = {.name = "equalto", .fn = t_equal, .binary = true},
    [T_ESCAPED] = {.name = "escaped", .fn = t_kind},
    [T_EVEN] = {.name = "even", .fn = t_divisible},
    [T_FALSE] = {.name = "false", .fn = t_kind},
    [T_FLOAT_] = {.name = "float", .fn = t_kind},
    [T_GE] = {.name = "ge", .fn = t_order, .binary = true},
    [T_GT] = {.name = "gt", .fn = t_order, .binary = true},
    [T_GREATERTHAN] = {.name = "greaterthan", .fn = t_order, .binary = true},
    [T_IN] = {.name = "in", .fn = t_in, .binary = true},
    [T_INTEGER] = {.name = "integer", .fn = t_kind},
    [T_ITERABLE] = {.name = "iterable", .fn = t_kind},
    [T_LE] = {.name = "le", .fn = t_order, .binary = true},
    [T_LESSTHAN] = {.name = "lessthan", .fn = t_order, .binary = true},
    [T_LOWER] = {.name = "lower", .fn = t_case},
    [T_LT] = {.name = "lt", .fn = t_order, .binary = true},
    [T_MAPPING] = {.name = "mapping", .fn = t_kind},
    [T_NE] = {.name = "ne", .fn = t_equal, .binary = true},
    [T_NONE] = {.name = "none", .fn = t_kind},
    [T_NUMBER] = {.name = "number", .fn = t_kind},
    [T_ODD] = {.name = "odd", .fn = t_divisible},
    [T_SAMEAS] = {.name = "sameas", .fn = t_equal, .binary = true},
    [T_SEQUENCE] = {.name = "sequence", .fn = t_kind},
    [T_STRING_] = {.name = "string", .fn = t_kind},
    [T_TRUE] = {.name = "true", .fn = t_kind},
    [T_UNDEFINED] = {.name = "undefined", .fn = t_kind},
    [T_UPPER] = {.name = "upper", .fn = t_case},
};

static int t_divisible(struct render *r, int idx, struct val v, struct val a, bool *out)
{
    int64_t x = 0, d = idx == T_DIVISIBLEBY ? 0 : 2;
    if (need_int(r, v, tests[idx].name, &x) != TDM_OK ||
        (idx == T_DIVISIBLEBY && need_int(r, a, "divisibleby", &d) != TDM_OK))
        return r->rc;
    if (d == 0)
        return chat_rerr(r, TDM_EINVAL, "integer division or modulo by zero");
    int64_t m = x % d;
    *out = idx == T_ODD ? m != 0 : m == 0;
    return TDM_OK;
}

int chat_builtin_test_index(const char *name)
{
    for (int i = 0; i < T_COUNT_ALL; i++)
        if (strcmp(tests[i].name, name) == 0)
            return i;
    return -1;
}

int chat_builtin_test(struct render *r, int idx, struct val v, const struct val *args, size_t nargs,
                      bool *out)
{
    if (idx < 0 || idx >= T_COUNT_ALL)
        return chat_rerr(r, TDM_EINVAL, "internal: unknown test %d", idx);
    struct val a = nargs ? args[0] : chat_v_undef(NULL);
    bool binary = tests[idx].binary;
    if (nargs != (binary ? 1u : 0u))
        return chat_rerr(r, TDM_EINVAL, "test '%s' takes %d argument(s), got %zu", tests[idx].name,
                         binary ? 1 : 0, nargs);
    return tests[idx].fn(r, idx, v, a, out);
}

int chat_v_contains(struct render *r, struct val hay, struct val needle, bool *out)
{
    switch (hay.kind) {
    case V_STR:
        if (needle.kind != V_STR)
            return chat_rerr(r, TDM_EINVAL, "'in <string>' requires string as left operand, not %s",
                             chat_v_type_name(needle));
        *out = find_bytes(hay.u.str.s, hay.u.str.n, needle.u.str.s, needle.u.str.n) != NULL;
        return TDM_OK;
    case V_LIST:
        *out = false;
        for (size_t i = 0; i < hay.u.list->n && !*out; i++)
            *out = chat_v_equal(hay.u.list->items[i], needle);
        return TDM_OK;
    case V_DICT: {
        struct val tmp;
        *out = chat_v_dict_find(hay.u.dict, needle, &tmp);
        return TDM_OK;
    }
    case V_UNDEF:
        *out = false;
        return TDM_OK;
    default:
        return chat_rerr(r, TDM_EINVAL, "argument of type '%s' is not iterable",
                         chat_v_type_name(hay));
    }
}

// ---- filter implementations --------------------------------------------------------------

static int soft_str(struct render *r, struct val v, struct val *out)
{
    return chat_v_stringify(r, v, out);
}

static int do_tojson(struct render *r, struct val v, const struct val *args,
                     const char *const *names, size_t nargs, struct val *out)
{
    // HF: tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False)
    struct tojson_opts o = {.indent = -1, .item_sep = ", ", .key_sep = ": "};
    struct val a;
    if (arg(args, names, nargs, 0, "ensure_ascii", &a))
        o.ensure_ascii = chat_v_truthy(a);
    if (arg(args, names, nargs, 1, "indent", &a) && a.kind != V_NONE) {
        if (a.kind == V_INT || a.kind == V_BOOL) {
            int64_t k = a.kind == V_INT ? a.u.i : a.u.b;
            if (k > 64)
                return chat_rerr(r, TDM_EINVAL, "tojson: indent %lld is too large", (long long)k);
            o.indent = k < 0 ? 0 : (int)k;
        } else if (a.kind == V_STR) {
            char *s = cstr(r, a.u.str.s, a.u.str.n);
            if (!s)
                return oom_cap(r);
            o.indent_str = s;
            o.indent = 0;
        } else {
            return chat_rerr(r, TDM_EINVAL, "tojson: indent must be an int or a string");
        }
        o.item_sep = ",";
    }
    if (arg(args, names, nargs, 2, "separators", &a) && a.kind != V_NONE) {
        if (a.kind != V_LIST || a.u.list->n != 2 || a.u.list->items[0].kind != V_STR ||
            a.u.list->items[1].kind != V_STR)
            return chat_rerr(r, TDM_EINVAL, "tojson: separators must be a pair of strings");
        o.item_sep = cstr(r, a.u.list->items[0].u.str.s, a.u.list->items[0].u.str.n);
        o.key_sep = cstr(r, a.u.list->items[1].u.str.s, a.u.list->items[1].u.str.n);
        if (!o.item_sep || !o.key_sep)
            return oom_cap(r);
    }
    if (arg(args, names, nargs, 3, "sort_keys", &a))
        o.sort_keys = chat_v_truthy(a);
    struct tdm_strbuf b = {.limit = CHAT_MAX_STRING};
    int rc = chat_val_to_json(r, v, &o, &b);
    if (rc == TDM_OK)
        rc = chat_sb_to_val(r, &b, out);
    free(b.p);
    return rc;
}

static int do_indent(struct render *r, struct val s, const struct val *args,
                     const char *const *names, size_t nargs, struct val *out)
{
    struct val w = chat_v_int(4), first = chat_v_bool(false), blank = chat_v_bool(false);
    arg(args, names, nargs, 0, "width", &w);
    arg(args, names, nargs, 1, "first", &first);
    arg(args, names, nargs, 2, "blank", &blank);
    struct val ind;
    if (w.kind == V_STR) {
        ind = w;
    } else {
        int64_t k = 0;
        if (need_int(r, w, "indent", &k) != TDM_OK)
            return r->rc;
        if (k > 1024)
            return chat_rerr(r, TDM_EINVAL, "indent: width %lld is too large", (long long)k);
        if (k < 0)
            k = 0;
        char *sp = chat_arena_alloc(&r->arena, (size_t)k + 1);
        if (!sp)
            return oom_cap(r);
        memset(sp, ' ', (size_t)k);
        ind = chat_v_strn(sp, (size_t)k);
    }
    // s += "\n"; lines = s.splitlines()
    struct val text;
    struct tdm_strbuf tb = {.limit = CHAT_MAX_STRING};
    tdm_strbuf_add(&tb, s.u.str.s, s.u.str.n);
    tdm_strbuf_addc(&tb, '\n');
    int trc = chat_sb_to_val(r, &tb, &text);
    free(tb.p);
    if (trc != TDM_OK)
        return trc;
    struct val lines;
    if (do_splitlines(r, text, false, &lines) != TDM_OK)
        return r->rc;
    struct tdm_strbuf b = {.limit = CHAT_MAX_STRING};
    struct vlist *l = lines.u.list;
    if (chat_v_truthy(first))
        tdm_strbuf_add(&b, ind.u.str.s, ind.u.str.n);
    for (size_t i = 0; i < l->n; i++) {
        if (i > 0) {
            tdm_strbuf_addc(&b, '\n');
            if (chat_v_truthy(blank) || l->items[i].u.str.n)
                tdm_strbuf_add(&b, ind.u.str.s, ind.u.str.n);
        }
        tdm_strbuf_add(&b, l->items[i].u.str.s, l->items[i].u.str.n);
    }
    int rc = chat_sb_to_val(r, &b, out);
    free(b.p);
    return rc;
}

// select/reject (attr == false) and selectattr/rejectattr (attr == true).
static int do_select(struct render *r, struct val in, const struct val *args,
                     const char *const *names, size_t nargs, bool by_attr, bool keep_if,
                     struct val *out)
{
    struct val items;
    if (chat_v_list_new(r, 0, out) != TDM_OK)
        return r->rc;
    out->u.list->gen = true;
    if (!chat_v_truthy(in)) // Jinja: `if value:` before iterating
        return TDM_OK;
    if (chat_v_iterate(r, in, &items) != TDM_OK)
        return r->rc;
    size_t np = npositional(names, nargs);
    size_t first = by_attr ? 1 : 0;
    struct val attr = chat_v_undef(NULL), testname = chat_v_undef(NULL);
    if (by_attr && !arg(args, names, nargs, 0, NULL, &attr))
        return chat_rerr(r, TDM_EINVAL, "selectattr/rejectattr need an attribute name");
    int test = -1;
    if (arg(args, names, nargs, first, NULL, &testname)) {
        if (need_str(r, testname, "select test") != TDM_OK)
            return r->rc;
        char *tn = cstr(r, testname.u.str.s, testname.u.str.n);
        if (!tn)
            return oom_cap(r);
        test = chat_builtin_test_index(tn);
        if (test < 0)
            return chat_rerr(r, TDM_EINVAL, "unknown test '%s'", tn);
    }
    size_t ntest_args = np > first + 1 ? np - first - 1 : 0;
    for (size_t i = 0; i < items.u.list->n; i++) {
        if (!chat_charge(r, 1))
            return r->rc;
        struct val item = items.u.list->items[i], v = item;
        if (by_attr && attr_path(r, item, attr, &v) != TDM_OK)
            return r->rc;
        bool ok;
        if (test >= 0) {
            if (chat_builtin_test(r, test, v, args + first + 1, ntest_args, &ok) != TDM_OK)
                return r->rc;
        } else {
            ok = chat_v_truthy(v);
        }
        if (ok == keep_if && chat_v_list_push(r, out->u.list, item) != TDM_OK)
            return r->rc;
    }
    return TDM_OK;
}

static int do_map(struct render *r, struct val in, const struct val *args, const char *const *names,
                  size_t nargs, struct val *out)
{
    struct val items, attr, def = chat_v_undef(NULL), fname;
    if (chat_v_list_new(r, 0, out) != TDM_OK)
        return r->rc;
    out->u.list->gen = true;
    if (!chat_v_truthy(in)) // Jinja: `if value:` before iterating
        return TDM_OK;
    if (chat_v_iterate(r, in, &items) != TDM_OK)
        return r->rc;
    bool has_default = arg(args, names, nargs, SIZE_MAX, "default", &def);
    if (arg(args, names, nargs, SIZE_MAX, "attribute", &attr)) {
        for (size_t i = 0; i < items.u.list->n; i++) {
            struct val v;
            if (attr_path(r, items.u.list->items[i], attr, &v) != TDM_OK)
                return r->rc;
            if (v.kind == V_UNDEF && has_default)
                v = def;
            if (chat_v_list_push(r, out->u.list, v) != TDM_OK)
                return r->rc;
        }
        return TDM_OK;
    }
    if (!arg(args, names, nargs, 0, NULL, &fname) || need_str(r, fname, "map") != TDM_OK)
        return chat_rerr(r, TDM_EINVAL, "map needs a filter name or attribute=");
    char *fn = cstr(r, fname.u.str.s, fname.u.str.n);
    if (!fn)
        return oom_cap(r);
    int f = chat_builtin_filter_index(fn);
    if (f < 0)
        return chat_rerr(r, TDM_EINVAL, "unknown filter '%s' in map", fn);
    // The filter's own arguments follow its name.
    size_t rest = nargs - 1;
    for (size_t i = 0; i < items.u.list->n; i++) {
        struct val v;
        if (chat_builtin_filter(r, f, items.u.list->items[i], args + 1, names ? names + 1 : NULL,
                                rest, &v) != TDM_OK ||
            chat_v_list_push(r, out->u.list, v) != TDM_OK)
            return r->rc;
    }
    return TDM_OK;
}

// Sort key comparison; strings compare case-insensitively unless case_sensitive.
static int sort_cmp(struct render *r, struct val a, struct val b, bool case_sensitive, int *cmp)
{
    if (!case_sensitive && a.kind == V_STR && b.kind == V_STR) {
        struct val la, lb;
        if (map_case(r, a, 1, &la) != TDM_OK || map_case(r, b, 1, &lb) != TDM_OK)
            return r->rc;
        return chat_v_compare(r, la, lb, cmp);
    }
    return chat_v_compare(r, a, b, cmp);
}

static int do_sort(struct render *r, struct val in, bool reverse, bool case_sensitive,
                   struct val attr, bool by_key_of_pair, struct val *out)
{
    struct val items;
    if (chat_v_iterate(r, in, &items) != TDM_OK ||
        chat_v_list_new(r, items.u.list->n, out) != TDM_OK)
        return r->rc;
    size_t n = items.u.list->n;
    struct val *keys = calloc(n ? n : 1, sizeof *keys);
    if (!keys)
        return chat_rerr(r, TDM_ENOMEM, "out of memory");
    int rc = TDM_OK;
    for (size_t i = 0; i < n && rc == TDM_OK; i++) {
        struct val it = items.u.list->items[i];
        chat_v_list_push(r, out->u.list, it);
        if (by_key_of_pair)
            keys[i] = it.u.list->items[0];
        else if (attr.kind != V_UNDEF)
            rc = attr_path(r, it, attr, &keys[i]);
        else
            keys[i] = it;
    }
    // Stable insertion sort (templates sort a handful of items).
    for (size_t i = 1; i < n && rc == TDM_OK; i++) {
        struct val k = keys[i], it = out->u.list->items[i];
        size_t j = i;
        while (j > 0 && rc == TDM_OK) {
            int cmp;
            if (!chat_charge(r, 1) ||
                (rc = sort_cmp(r, keys[j - 1], k, case_sensitive, &cmp)) != TDM_OK) {
                rc = r->rc;
                break;
            }
            if (reverse ? cmp >= 0 : cmp <= 0)
                break;
            keys[j] = keys[j - 1];
            out->u.list->items[j] = out->u.list->items[j - 1];
            j--;
        }
        keys[j] = k;
        out->u.list->items[j] = it;
    }
    free(keys);
    return rc;
}

static int parse_int_text(const char *s, size_t n, int base, int64_t *out)
{
    char buf[80];
    size_t o = 0, i = 0;
    while (i < n && (s[i] == ' ' || s[i] == '\t' || s[i] == '\n' || s[i] == '\r'))
        i++;
    while (n > i && (s[n - 1] == ' ' || s[n - 1] == '\t' || s[n - 1] == '\n' || s[n - 1] == '\r'))
        n--;
    for (; i < n && o < sizeof buf - 1; i++)
        if (s[i] != '_')
            buf[o++] = s[i];
    buf[o] = '\0';
    if (o == 0)
        return -1;
    char *end;
    long long v = strtoll(buf, &end, base);
    if (*end)
        return -1;
    *out = v;
    return 0;
}

static int parse_float_text(const char *s, size_t n, double *out)
{
    char buf[80];
    if (n == 0 || n >= sizeof buf)
        return -1;
    memcpy(buf, s, n);
    buf[n] = '\0';
    char *end;
    double d = strtod(buf, &end);
    while (*end == ' ' || *end == '\t' || *end == '\n')
        end++;
    if (*end || end == buf)
        return -1;
    *out = d;
    return 0;
}

// One filter call: its index (filters sharing a function tell theirs apart by
// it) and its arguments after the input.
struct fcall {
    int idx;
    const struct val *args;
    const char *const *names;
    size_t nargs;
};

// The call's argument at position pos or named name (arg).
static bool farg(const struct fcall *c, size_t pos, const char *name, struct val *out)
{
    return arg(c->args, c->names, c->nargs, pos, name, out);
}

typedef int (*filter_fn)(struct render *r, const struct fcall *call, struct val in,
                         struct val *out);

static int f_abs(struct render *r, const struct fcall *call, struct val in, struct val *out)
{
    (void)call;
    if (in.kind == V_INT && in.u.i != INT64_MIN)
        *out = chat_v_int(in.u.i < 0 ? -in.u.i : in.u.i);
    else if (in.kind == V_FLOAT)
        *out = chat_v_float(fabs(in.u.f));
    else if (in.kind == V_BOOL)
        *out = chat_v_int(in.u.b);
    else
        return chat_rerr(r, TDM_EINVAL, "bad operand type for abs(): '%s'", chat_v_type_name(in));
    return TDM_OK;
}

static int f_attr(struct render *r, const struct fcall *call, struct val in, struct val *out)
{
    struct val a;
    if (!farg(call, 0, "name", &a) || need_str(r, a, "attr") != TDM_OK)
        return chat_rerr(r, TDM_EINVAL, "attr needs a name");
    return chat_get_attr(r, in, a.u.str.s, a.u.str.n, out);
}

static int f_case(struct render *r, const struct fcall *call, struct val in, struct val *out)
{
    struct val s;
    int rc;
    if ((rc = soft_str(r, in, &s)) != TDM_OK)
        return rc;
    return map_case(r, s, call->idx == F_UPPER ? 0 : call->idx == F_LOWER ? 1 : 2, out);
}

static int f_title(struct render *r, const struct fcall *call, struct val in, struct val *out)
{
    (void)call;
    struct val s;
    int rc;
    // Jinja: words split on [-\s({[<]+; each word's first character upper, the
    // rest lower.
    if ((rc = soft_str(r, in, &s)) != TDM_OK)
        return rc;
    struct tdm_strbuf tb = {.limit = CHAT_MAX_STRING};
    bool start = true;
    for (size_t i = 0; i < s.u.str.n;) {
        uint32_t cp;
        size_t len = tdm_utf8_next(s.u.str.s, s.u.str.n, i, &cp);
        bool sep =
            cp == '-' || chat_py_isspace(cp) || cp == '(' || cp == '{' || cp == '[' || cp == '<';
        if (sep)
            tdm_strbuf_add(&tb, s.u.str.s + i, len);
        else
            put_case(&tb, cp, start, start);
        start = sep;
        i += len;
    }
    rc = chat_sb_to_val(r, &tb, out);
    free(tb.p);
    return rc;
}

static int f_length(struct render *r, const struct fcall *call, struct val in, struct val *out)
{
    (void)call;
    switch (in.kind) {
    case V_STR:
        *out = chat_v_int((int64_t)chat_utf8_len(in.u.str.s, in.u.str.n));
        return TDM_OK;
    case V_LIST:
        if (in.u.list->gen)
            return chat_rerr(r, TDM_EINVAL, "object of type 'generator' has no len()");
        *out = chat_v_int((int64_t)in.u.list->n);
        return TDM_OK;
    case V_DICT:
        *out = chat_v_int((int64_t)in.u.dict->n);
        return TDM_OK;
    case V_UNDEF:
        *out = chat_v_int(0);
        return TDM_OK;
    case V_LOOP:
        *out = chat_v_int(in.u.loop->length);
        return TDM_OK;
    default:
        return chat_rerr(r, TDM_EINVAL, "object of type '%s' has no len()", chat_v_type_name(in));
    }
}

static int f_default(struct render *r, const struct fcall *call, struct val in, struct val *out)
{
    (void)r;
    struct val def = chat_v_strn("", 0), boolean = chat_v_bool(false);
    farg(call, 0, "default_value", &def);
    farg(call, 1, "boolean", &boolean);
    *out = in.kind == V_UNDEF || (chat_v_truthy(boolean) && !chat_v_truthy(in)) ? def : in;
    return TDM_OK;
}

static int f_dictsort(struct render *r, const struct fcall *call, struct val in, struct val *out)
{
    if (in.kind != V_DICT)
        return chat_rerr(r, TDM_EINVAL, "dictsort needs a mapping, got %s", chat_v_type_name(in));
    struct val cs = chat_v_bool(false), by = chat_v_strn("key", 3), rev = chat_v_bool(false), pairs;
    farg(call, 0, "case_sensitive", &cs);
    farg(call, 1, "by", &by);
    farg(call, 2, "reverse", &rev);
    if (chat_v_list_new(r, in.u.dict->n, &pairs) != TDM_OK)
        return r->rc;
    for (size_t i = 0; i < in.u.dict->n; i++) {
        struct val t;
        if (chat_v_list_new(r, 2, &t) != TDM_OK)
            return r->rc;
        t.u.list->tuple = true;
        chat_v_list_push(r, t.u.list, in.u.dict->keys[i]);
        chat_v_list_push(r, t.u.list, in.u.dict->vals[i]);
        chat_v_list_push(r, pairs.u.list, t);
    }
    bool by_value = by.kind == V_STR && by.u.str.n == 5 && memcmp(by.u.str.s, "value", 5) == 0;
    return do_sort(r, pairs, chat_v_truthy(rev), chat_v_truthy(cs),
                   by_value ? chat_v_int(1) : chat_v_int(0), false, out);
}

static int f_escape(struct render *r, const struct fcall *call, struct val in, struct val *out)
{
    struct val s;
    int rc;
    if (in.kind == V_STR && in.markup && call->idx != F_FORCEESCAPE) {
        *out = in;
        return TDM_OK;
    }
    if ((rc = soft_str(r, in, &s)) != TDM_OK)
        return rc;
    struct tdm_strbuf bb = {.limit = CHAT_MAX_STRING};
    chat_html_escape(&bb, s.u.str.s, s.u.str.n);
    rc = chat_sb_to_val(r, &bb, out);
    free(bb.p);
    out->markup = true;
    return rc;
}

static int f_first_last(struct render *r, const struct fcall *call, struct val in, struct val *out)
{
    struct val items;
    if (call->idx == F_LAST && in.kind == V_LIST && in.u.list->gen)
        return chat_rerr(r, TDM_EINVAL, "'generator' object is not reversible");
    if (chat_v_iterate(r, in, &items) != TDM_OK)
        return r->rc;
    if (items.u.list->n == 0)
        *out = chat_v_undef(call->idx == F_FIRST ? "first" : "last");
    else
        *out = items.u.list->items[call->idx == F_FIRST ? 0 : items.u.list->n - 1];
    return TDM_OK;
}

static int f_float(struct render *r, const struct fcall *call, struct val in, struct val *out)
{
    (void)r;
    struct val def = chat_v_float(0.0);
    farg(call, 0, "default", &def);
    double d;
    if (in.kind == V_FLOAT)
        *out = in;
    else if (in.kind == V_INT || in.kind == V_BOOL)
        *out = chat_v_float(in.kind == V_INT ? (double)in.u.i : in.u.b);
    else if (in.kind == V_STR && parse_float_text(in.u.str.s, in.u.str.n, &d) == 0)
        *out = chat_v_float(d);
    else
        *out = def;
    return TDM_OK;
}

static int f_int(struct render *r, const struct fcall *call, struct val in, struct val *out)
{
    (void)r;
    struct val def = chat_v_int(0), base = chat_v_int(10);
    farg(call, 0, "default", &def);
    farg(call, 1, "base", &base);
    int64_t i;
    double d;
    if (in.kind == V_INT)
        *out = in;
    else if (in.kind == V_BOOL)
        *out = chat_v_int(in.u.b);
    else if (in.kind == V_FLOAT && isfinite(in.u.f) && fabs(in.u.f) < 9.2e18)
        *out = chat_v_int((int64_t)in.u.f);
    else if (in.kind == V_STR && parse_int_text(in.u.str.s, in.u.str.n,
                                                base.kind == V_INT ? (int)base.u.i : 10, &i) == 0)
        *out = chat_v_int(i);
    else if (in.kind == V_STR && parse_float_text(in.u.str.s, in.u.str.n, &d) == 0 && isfinite(d) &&
             fabs(d) < 9.2e18)
        *out = chat_v_int((int64_t)d);
    else
        *out = def;
    return TDM_OK;
}

static int f_indent(struct render *r, const struct fcall *call, struct val in, struct val *out)
{
    struct val s;
    int rc;
    if ((rc = soft_str(r, in, &s)) != TDM_OK)
        return rc;
    return do_indent(r, s, call->args, call->names, call->nargs, out);
}

static int f_items(struct render *r, const struct fcall *call, struct val in, struct val *out)
{
    (void)call;
    if (in.kind == V_UNDEF)
        return chat_v_list_new(r, 0, out);
    if (in.kind != V_DICT)
        return chat_rerr(r, TDM_EINVAL, "Can only get item pairs from a mapping.");
    if (chat_v_list_new(r, in.u.dict->n, out) != TDM_OK)
        return r->rc;
    for (size_t i = 0; i < in.u.dict->n; i++) {
        struct val t;
        if (chat_v_list_new(r, 2, &t) != TDM_OK)
            return r->rc;
        t.u.list->tuple = true;
        chat_v_list_push(r, t.u.list, in.u.dict->keys[i]);
        chat_v_list_push(r, t.u.list, in.u.dict->vals[i]);
        chat_v_list_push(r, out->u.list, t);
    }
    out->u.list->gen = true;
    return r->rc;
}

static int f_join(struct render *r, const struct fcall *call, struct val in, struct val *out)
{
    int rc;
    struct val items, sep = chat_v_strn("", 0), attr;
    farg(call, 0, "d", &sep);
    if (chat_v_iterate(r, in, &items) != TDM_OK)
        return r->rc;
    if (sep.kind != V_STR && soft_str(r, sep, &sep) != TDM_OK)
        return r->rc;
    bool by_attr = farg(call, 1, "attribute", &attr);
    struct tdm_strbuf bb = {.limit = CHAT_MAX_STRING};
    rc = TDM_OK;
    for (size_t i = 0; i < items.u.list->n && rc == TDM_OK; i++) {
        struct val it = items.u.list->items[i];
        if (by_attr && (rc = attr_path(r, it, attr, &it)) != TDM_OK)
            break;
        if (i)
            tdm_strbuf_add(&bb, sep.u.str.s, sep.u.str.n);
        rc = chat_v_to_text(r, it, &bb);
    }
    if (rc == TDM_OK)
        rc = chat_sb_to_val(r, &bb, out);
    free(bb.p);
    return rc;
}

static int f_list(struct render *r, const struct fcall *call, struct val in, struct val *out)
{
    (void)call;
    struct val a;
    int rc;
    if ((rc = chat_v_iterate(r, in, &a)) != TDM_OK)
        return rc;
    if (chat_v_list_new(r, a.u.list->n, out) != TDM_OK)
        return r->rc;
    for (size_t i = 0; i < a.u.list->n; i++)
        chat_v_list_push(r, out->u.list, a.u.list->items[i]);
    return r->rc;
}

static int f_map(struct render *r, const struct fcall *call, struct val in, struct val *out)
{
    return do_map(r, in, call->args, call->names, call->nargs, out);
}

static int f_max_min(struct render *r, const struct fcall *call, struct val in, struct val *out)
{
    struct val items, cs = chat_v_bool(false), attr = chat_v_undef(NULL), sorted;
    farg(call, 0, "case_sensitive", &cs);
    farg(call, 1, "attribute", &attr);
    if (chat_v_iterate(r, in, &items) != TDM_OK)
        return r->rc;
    if (items.u.list->n == 0) {
        *out = chat_v_undef(call->idx == F_MAX ? "max" : "min");
        return TDM_OK;
    }
    if (do_sort(r, items, call->idx == F_MAX, chat_v_truthy(cs), attr, false, &sorted) != TDM_OK)
        return r->rc;
    *out = sorted.u.list->items[0];
    return TDM_OK;
}

static int f_select(struct render *r, const struct fcall *call, struct val in, struct val *out)
{
    return do_select(r, in, call->args, call->names, call->nargs, false, call->idx == F_SELECT,
                     out);
}

static int f_selectattr(struct render *r, const struct fcall *call, struct val in, struct val *out)
{
    return do_select(r, in, call->args, call->names, call->nargs, true, call->idx == F_SELECTATTR,
                     out);
}

static int f_replace(struct render *r, const struct fcall *call, struct val in, struct val *out)
{
    struct val a, b, s;
    int rc;
    struct val count = chat_v_none();
    if ((rc = soft_str(r, in, &s)) != TDM_OK)
        return rc;
    if (!farg(call, 0, "old", &a) || !farg(call, 1, "new", &b))
        return chat_rerr(r, TDM_EINVAL, "replace needs old and new");
    farg(call, 2, "count", &count);
    int64_t c = -1;
    if (count.kind != V_NONE && need_int(r, count, "replace count", &c) != TDM_OK)
        return r->rc;
    return do_replace(r, s, a, b, c, out);
}

static int f_reverse(struct render *r, const struct fcall *call, struct val in, struct val *out)
{
    (void)call;
    struct val a;
    int rc;
    if (in.kind == V_STR) {
        struct val chars;
        if (chat_v_iterate(r, in, &chars) != TDM_OK)
            return r->rc;
        struct tdm_strbuf bb = {.limit = CHAT_MAX_STRING};
        for (size_t i = chars.u.list->n; i-- > 0;)
            tdm_strbuf_add(&bb, chars.u.list->items[i].u.str.s, chars.u.list->items[i].u.str.n);
        rc = chat_sb_to_val(r, &bb, out);
        free(bb.p);
        return rc;
    }
    if ((rc = chat_v_iterate(r, in, &a)) != TDM_OK ||
        chat_v_list_new(r, a.u.list->n, out) != TDM_OK)
        return r->rc;
    for (size_t i = a.u.list->n; i-- > 0;)
        chat_v_list_push(r, out->u.list, a.u.list->items[i]);
    out->u.list->gen = true; // reversed(): an iterator
    return r->rc;
}

static int f_round(struct render *r, const struct fcall *call, struct val in, struct val *out)
{
    struct val prec = chat_v_int(0), method = chat_v_strn("common", 6);
    farg(call, 0, "precision", &prec);
    farg(call, 1, "method", &method);
    int64_t p = 0;
    if (need_int(r, prec, "round precision", &p) != TDM_OK)
        return r->rc;
    if (in.kind != V_INT && in.kind != V_FLOAT && in.kind != V_BOOL)
        return chat_rerr(r, TDM_EINVAL, "round needs a number, got %s", chat_v_type_name(in));
    double x = in.kind == V_FLOAT ? in.u.f : in.kind == V_INT ? (double)in.u.i : in.u.b;
    double m = pow(10.0, (double)p);
    const char *how = method.kind == V_STR ? method.u.str.s : "common";
    double y = strncmp(how, "ceil", 4) == 0    ? ceil(x * m) / m
               : strncmp(how, "floor", 5) == 0 ? floor(x * m) / m
                                               : nearbyint(x * m) / m;
    *out = in.kind == V_FLOAT || strncmp(how, "common", 6) != 0 ? chat_v_float(y)
                                                                : chat_v_int((int64_t)y);
    return TDM_OK;
}

static int f_safe(struct render *r, const struct fcall *call, struct val in, struct val *out)
{
    (void)call;
    int rc;
    if ((rc = soft_str(r, in, out)) != TDM_OK)
        return rc;
    out->markup = true;
    return TDM_OK;
}

static int f_sort(struct render *r, const struct fcall *call, struct val in, struct val *out)
{
    struct val rev = chat_v_bool(false), cs = chat_v_bool(false), attr = chat_v_undef(NULL);
    farg(call, 0, "reverse", &rev);
    farg(call, 1, "case_sensitive", &cs);
    farg(call, 2, "attribute", &attr);
    return do_sort(r, in, chat_v_truthy(rev), chat_v_truthy(cs), attr, false, out);
}

static int f_string(struct render *r, const struct fcall *call, struct val in, struct val *out)
{
    (void)call;
    return soft_str(r, in, out);
}

static int f_sum(struct render *r, const struct fcall *call, struct val in, struct val *out)
{
    struct val attr = chat_v_undef(NULL), start = chat_v_int(0), items;
    farg(call, 0, "attribute", &attr);
    farg(call, 1, "start", &start);
    if (chat_v_iterate(r, in, &items) != TDM_OK)
        return r->rc;
    struct val acc = start;
    for (size_t i = 0; i < items.u.list->n; i++) {
        struct val it = items.u.list->items[i];
        if (attr.kind != V_UNDEF && attr_path(r, it, attr, &it) != TDM_OK)
            return r->rc;
        bool fl = acc.kind == V_FLOAT || it.kind == V_FLOAT;
        if (!(acc.kind == V_INT || acc.kind == V_FLOAT || acc.kind == V_BOOL) ||
            !(it.kind == V_INT || it.kind == V_FLOAT || it.kind == V_BOOL))
            return chat_rerr(r, TDM_EINVAL, "sum: unsupported operand types '%s' and '%s'",
                             chat_v_type_name(acc), chat_v_type_name(it));
        double fa = acc.kind == V_FLOAT ? acc.u.f : acc.kind == V_INT ? (double)acc.u.i : acc.u.b;
        double fb = it.kind == V_FLOAT ? it.u.f : it.kind == V_INT ? (double)it.u.i : it.u.b;
        int64_t ia = acc.kind == V_INT ? acc.u.i : acc.u.b, ib = it.kind == V_INT ? it.u.i : it.u.b,
                z;
        if (fl)
            acc = chat_v_float(fa + fb);
        else if (__builtin_add_overflow(ia, ib, &z))
            return chat_rerr(r, TDM_EINVAL, "integer overflow in sum");
        else
            acc = chat_v_int(z);
    }
    *out = acc;
    return TDM_OK;
}

static int f_tojson(struct render *r, const struct fcall *call, struct val in, struct val *out)
{
    return do_tojson(r, in, call->args, call->names, call->nargs, out);
}

static int f_trim(struct render *r, const struct fcall *call, struct val in, struct val *out)
{
    struct val s;
    int rc;
    struct val chars = chat_v_none();
    farg(call, 0, "chars", &chars);
    if ((rc = soft_str(r, in, &s)) != TDM_OK)
        return rc;
    return do_strip(r, s, chars, true, true, out);
}

static int f_unique(struct render *r, const struct fcall *call, struct val in, struct val *out)
{
    struct val items, cs = chat_v_bool(false), attr = chat_v_undef(NULL);
    farg(call, 0, "case_sensitive", &cs);
    farg(call, 1, "attribute", &attr);
    if (chat_v_iterate(r, in, &items) != TDM_OK || chat_v_list_new(r, 0, out) != TDM_OK)
        return r->rc;
    struct val seen;
    if (chat_v_list_new(r, 0, &seen) != TDM_OK)
        return r->rc;
    for (size_t i = 0; i < items.u.list->n; i++) {
        struct val it = items.u.list->items[i], key = it;
        if (attr.kind != V_UNDEF && attr_path(r, it, attr, &key) != TDM_OK)
            return r->rc;
        if (!chat_v_truthy(cs) && key.kind == V_STR && map_case(r, key, 1, &key) != TDM_OK)
            return r->rc;
        bool dup = false;
        if (!chat_charge(r, seen.u.list->n))
            return r->rc;
        for (size_t j = 0; j < seen.u.list->n && !dup; j++)
            dup = chat_v_equal(seen.u.list->items[j], key);
        if (!dup && (chat_v_list_push(r, seen.u.list, key) != TDM_OK ||
                     chat_v_list_push(r, out->u.list, it) != TDM_OK))
            return r->rc;
    }
    out->u.list->gen = true;
    return TDM_OK;
}

static int f_wordcount(struct render *r, const struct fcall *call, struct val in, struct val *out)
{
    (void)call;
    struct val s;
    int rc;
    if ((rc = soft_str(r, in, &s)) != TDM_OK)
        return rc;
    int64_t words = 0;
    bool in_word = false;
    for (size_t i = 0; i < s.u.str.n; i++) {
        unsigned char c = (unsigned char)s.u.str.s[i];
        bool w = c >= 0x80 || c == '_' || (c >= '0' && c <= '9') || ascii_alpha((char)c);
        if (w && !in_word)
            words++;
        in_word = w;
    }
    *out = chat_v_int(words);
    return TDM_OK;
}

// The filters: name, function, and the parameters after the input in order,
// as Jinja2 (and HF's tojson) declare them (NULL ends the list); varargs ones
// (map, select, reject, selectattr, rejectattr) take *args and **kwargs and
// are not checked by check_filter_args.
static const struct filter {
    const char *name;
    filter_fn fn;
    const char *params[5];
    bool varargs;
} filters[F_COUNT_ALL] = {
    [F_ABS] = {.name = "abs", .fn = f_abs},
    [F_ATTR] = {.name = "attr", .fn = f_attr, .params = {"name"}},
    [F_CAPITALIZE] = {.name = "capitalize", .fn = f_case},
    [F_COUNT] = {.name = "count", .fn = f_length},
    [F_D] = {.name = "d", .fn = f_default, .params = {"default_value", "boolean"}},
    [F_DEFAULT] = {.name = "default", .fn = f_default, .params = {"default_value", "boolean"}},
    [F_DICTSORT] = {.name = "dictsort", .fn = f_dictsort, .params = {"case_sensitive", "by", "reverse"}},
    [F_E] = {.name = "e", .fn = f_escape},
    [F_ESCAPE] = {.name = "escape", .fn = f_escape},
    [F_FIRST] = {.name = "first", .fn = f_first_last},
    [F_FLOAT] = {.name = "float", .fn = f_float, .params = {"default"}},
    [F_FORCEESCAPE] = {.name = "forceescape", .fn = f_escape},
    [F_INDENT] = {.name = "indent", .fn = f_indent, .params = {"width", "first", "blank"}},
    [F_INT] = {.name = "int", .fn = f_int, .params = {"default", "base"}},
    [F_ITEMS] = {.name = "items", .fn = f_items},
    [F_JOIN] = {.name = "join", .fn = f_join, .params = {"d", "attribute"}},
    [F_LAST] = {.name = "last", .fn = f_first_last},
    [F_LENGTH] = {.name = "length", .fn = f_length},
    [F_LIST] = {.name = "list", .fn = f_list},
    [F_LOWER] = {.name = "lower", .fn = f_case},
    [F_MAP] = {.name = "map", .fn = f_map, .varargs = true},
    [F_MAX] = {.name = "max", .fn = f_max_min, .params = {"case_sensitive", "attribute"}},
    [F_MIN] = {.name = "min", .fn = f_max_min, .params = {"case_sensitive", "attribute"}},
    [F_REJECT] = {.name = "reject", .fn = f_select, .varargs = true},
    [F_REJECTATTR] = {.name = "rejectattr", .fn = f_selectattr, .varargs = true},
    [F_REPLACE] = {.name = "replace", .fn = f_replace, .params = {"old", "new", "count"}},
    [F_REVERSE] = {.name = "reverse", .fn = f_reverse},
    [F_ROUND] = {.name = "round", .fn = f_round, .params = {"precision", "method"}},
    [F_SAFE] = {.name = "safe", .fn = f_safe},
    [F_SELECT] = {.name = "select", .fn = f_select, .varargs = true},
    [F_SELECTATTR] = {.name = "selectattr", .fn = f_selectattr, .varargs = true},
    [F_SORT] = {.name = "sort", .fn = f_sort, .params = {"reverse", "case_sensitive", "attribute"}},
    [F_STRING] = {.name = "string", .fn = f_string},
    [F_SUM] = {.name = "sum", .fn = f_sum, .params = {"attribute", "start"}},
    [F_TITLE] = {.name = "title", .fn = f_title},
    [F_TOJSON] = {.name = "tojson", .fn = f_tojson, .params = {"ensure_ascii", "indent", "separators", "sort_keys"}},
    [F_TRIM] = {.name = "trim", .fn = f_trim, .params = {"chars"}},
    [F_UNIQUE] = {.name = "unique", .fn = f_unique, .params = {"case_sensitive", "attribute"}},
    [F_UPPER] = {.name = "upper", .fn = f_case},
    [F_WORDCOUNT] = {.name = "wordcount", .fn = f_wordcount},
};

int chat_builtin_filter_index(const char *name)
{
    for (int i = 0; i < F_COUNT_ALL; i++)
        if (strcmp(filters[i].name, name) == 0)
            return i;
    return -1;
}

// Python's TypeError for a call that does not fit the filter's signature.
static int check_filter_args(struct render *r, int idx, const char *const *names, size_t nargs)
{
    if (filters[idx].varargs)
        return TDM_OK;
    const char *const *params = filters[idx].params;
    size_t nparams = 0;
    while (nparams < 5 && params[nparams])
        nparams++;
    size_t npos = npositional(names, nargs);
    if (npos > nparams)
        return chat_rerr(r, TDM_EINVAL, "%s() takes %zu positional argument(s) but %zu were given",
                         filters[idx].name, nparams, npos);
    for (size_t i = 0; i < nargs; i++) {
        if (!names || !names[i])
            continue;
        size_t k;
        for (k = 0; k < nparams; k++)
            if (strcmp(params[k], names[i]) == 0)
                break;
        if (k == nparams)
            return chat_rerr(r, TDM_EINVAL, "%s() got an unexpected keyword argument '%s'",
                             filters[idx].name, names[i]);
        if (k < npos)
            return chat_rerr(r, TDM_EINVAL, "%s() got multiple values for argument '%s'",
                             filters[idx].name, names[i]);
    }
    return TDM_OK;
}

int chat_builtin_filter(struct render *r, int idx, struct val in, const struct val *args,
                        const char *const *names, size_t nargs, struct val *out)
{
    if (idx < 0 || idx >= F_COUNT_ALL)
        return chat_rerr(r, TDM_EINVAL, "internal: unknown filter %d", idx);
    if (check_filter_args(r, idx, names, nargs) != TDM_OK)
        return r->rc;
    if (!chat_charge(r, 1))
        return r->rc;
    const struct fcall c = {idx, args, names, nargs};
    return filters[idx].fn(r, &c, in, out);
}

// ---- globals -------------------------------------------------------------------------

enum { G_RAISE, G_STRFTIME, G_NAMESPACE, G_RANGE, G_DICT, G_COUNT_ALL };
static const char *const global_names[G_COUNT_ALL] = {
    [G_RAISE] = "raise_exception",
    [G_STRFTIME] = "strftime_now",
    [G_NAMESPACE] = "namespace",
    [G_RANGE] = "range",
    [G_DICT] = "dict",
};

int chat_builtin_global(const char *name, struct val *out)
{
    for (int i = 0; i < G_COUNT_ALL; i++) {
        if (strcmp(global_names[i], name) == 0) {
            *out = (struct val){.kind = V_FUNC, .u.func = i};
            return TDM_OK;
        }
    }
    return TDM_ENOTFOUND;
}

// Jinja's sandbox refuses ranges longer than this (MAX_RANGE).
#define CHAT_MAX_RANGE 100000

static int call_global(struct render *r, int fn, const struct val *args, const char *const *names,
                       size_t nargs, struct val *out)
{
    struct val a;
    switch (fn) {
    case G_RAISE: {
        struct tdm_strbuf b = {.limit = 1024};
        if (nargs)
            chat_v_to_text(r, args[0], &b);
        b.over = false;
        int rc = chat_rerr(r, TDM_EINVAL, "raise_exception: %s", b.p ? b.p : "");
        free(b.p);
        return rc;
    }
    case G_STRFTIME: {
        if (!arg(args, names, nargs, 0, "format", &a) || need_str(r, a, "strftime_now") != TDM_OK)
            return chat_rerr(r, TDM_EINVAL, "strftime_now needs a format string");
        char *fmtz = cstr(r, a.u.str.s, a.u.str.n);
        if (!fmtz)
            return oom_cap(r);
        time_t now = time(NULL);
        struct tm tm;
        localtime_r(&now, &tm);
        char buf[512];
        size_t n = strftime(buf, sizeof buf, fmtz, &tm);
        if (n == 0 && a.u.str.n)
            return chat_rerr(r, TDM_EINVAL, "strftime_now: format yields nothing or too much text");
        return chat_v_str_copy(r, buf, n, out);
    }
    case G_NAMESPACE:
    case G_DICT: {
        if (chat_v_dict_new(r, out) != TDM_OK)
            return r->rc;
        for (size_t i = 0; i < nargs; i++) {
            if (names && names[i]) {
                if (chat_v_dict_set(r, out->u.dict, chat_v_strn(names[i], strlen(names[i])),
                                    args[i]) != TDM_OK)
                    return r->rc;
            } else if (args[i].kind == V_DICT) {
                for (size_t k = 0; k < args[i].u.dict->n; k++)
                    if (chat_v_dict_set(r, out->u.dict, args[i].u.dict->keys[k],
                                        args[i].u.dict->vals[k]) != TDM_OK)
                        return r->rc;
            } else {
                return chat_rerr(r, TDM_EINVAL, "%s() takes keyword arguments or a dict",
                                 global_names[fn]);
            }
        }
        if (fn == G_NAMESPACE)
            out->kind = V_NS;
        return TDM_OK;
    }
    case G_RANGE: {
        int64_t lo = 0, hi = 0, step = 1;
        if (nargs == 1) {
            if (need_int(r, args[0], "range", &hi) != TDM_OK)
                return r->rc;
        } else if (nargs == 2 || nargs == 3) {
            if (need_int(r, args[0], "range", &lo) != TDM_OK ||
                need_int(r, args[1], "range", &hi) != TDM_OK ||
                (nargs == 3 && need_int(r, args[2], "range", &step) != TDM_OK))
                return r->rc;
        } else {
            return chat_rerr(r, TDM_EINVAL, "range expected 1 to 3 arguments, got %zu", nargs);
        }
        if (step == 0)
            return chat_rerr(r, TDM_EINVAL, "range() arg 3 must not be zero");
        double count = step > 0 ? ceil(((double)hi - (double)lo) / (double)step)
                                : ceil(((double)lo - (double)hi) / (double)-step);
        if (count > CHAT_MAX_RANGE)
            return chat_rerr(r, TDM_ECAPACITY, "range too big: %.0f items (limit %d)", count,
                             CHAT_MAX_RANGE);
        if (chat_v_list_new(r, count > 0 ? (size_t)count : 0, out) != TDM_OK)
            return r->rc;
        for (int64_t v = lo; step > 0 ? v < hi : v > hi; v += step)
            if (chat_v_list_push(r, out->u.list, chat_v_int(v)) != TDM_OK)
                return r->rc;
        return TDM_OK;
    }
    }
    return chat_rerr(r, TDM_EINVAL, "internal: unknown global %d", fn);
}

// ---- methods -------------------------------------------------------------------------

// The [start:end] window of str.startswith/endswith/find/rfind/index/rindex/count,
// arguments 2 and 3 (ints or None) adjusted as CPython does (negative counts from
// the end, then clamped to [0, len]), as byte offsets [*b0, *b1) of self; *cp0 is
// the code point index of *b0 and *cps the window's length in code points, negative
// when start lies past end (Python then answers False / -1 / 0, even for "").
static int str_window(struct render *r, struct val self, const struct val *args,
                      const char *const *names, size_t nargs, const char *m, size_t *b0,
                      size_t *b1, int64_t *cp0, int64_t *cps)
{
    if (npositional(names, nargs) != nargs)
        return chat_rerr(r, TDM_EINVAL, "%s() takes no keyword arguments", m);
    if (nargs > 3)
        return chat_rerr(r, TDM_EINVAL, "%s() takes at most 3 arguments (%zu given)", m, nargs);
    int64_t len = (int64_t)chat_utf8_len(self.u.str.s, self.u.str.n);
    int64_t lim[2] = {0, len};
    for (size_t k = 0; k < 2 && k + 1 < nargs; k++) {
        struct val v = args[k + 1];
        if (v.kind == V_NONE)
            continue;
        if (v.kind != V_INT && v.kind != V_BOOL)
            return chat_rerr(r, TDM_EINVAL,
                             "slice indices must be integers or None, not %s (%s() argument %zu)",
                             chat_v_type_name(v), m, k + 2);
        int64_t x = v.kind == V_INT ? v.u.i : v.u.b;
        if (x < 0)
            x = x + len < 0 ? 0 : x + len;
        lim[k] = x > len ? len : x;
        if (k == 0 && x > len)
            lim[0] = len + 1; // past the end: an empty window that matches nothing
    }
    *cp0 = lim[0];
    *cps = lim[1] - lim[0];
    // Code point -> byte offsets, one walk.
    size_t i = 0;
    int64_t k = 0;
    uint32_t cp;
    *b0 = *b1 = self.u.str.n;
    while (i < self.u.str.n) {
        if (k == lim[0])
            *b0 = i;
        if (k == lim[1]) {
            *b1 = i;
            break;
        }
        i += tdm_utf8_next(self.u.str.s, self.u.str.n, i, &cp);
        k++;
    }
    if (*cps < 0)
        *b1 = *b0;
    return TDM_OK;
}

static int prefix_test(struct render *r, struct val self, size_t b0, size_t b1, int64_t cps,
                       struct val a, bool end, bool *res)
{
    *res = false;
    if (a.kind == V_LIST && a.u.list->tuple) {
        for (size_t i = 0; i < a.u.list->n && !*res; i++)
            if (prefix_test(r, self, b0, b1, cps, a.u.list->items[i], end, res) != TDM_OK)
                return r->rc;
        return TDM_OK;
    }
    if (a.kind != V_STR)
        return chat_rerr(r, TDM_EINVAL, "%s first arg must be str or a tuple of str, not %s",
                         end ? "endswith" : "startswith", chat_v_type_name(a));
    size_t n = a.u.str.n;
    *res = cps >= 0 && n <= b1 - b0 &&
           memcmp(self.u.str.s + (end ? b1 - n : b0), a.u.str.s, n) == 0;
    return TDM_OK;
}

// One str method call: the method's name (functions shared by several
// methods tell theirs apart by it) and its arguments.
struct mcall {
    const char *m;
    const struct val *args;
    const char *const *names;
    size_t nargs;
};

static bool marg(const struct mcall *c, size_t pos, const char *name, struct val *out)
{
    return arg(c->args, c->names, c->nargs, pos, name, out);
}

#define M(s) (strcmp(call->m, s) == 0)
static int s_prefix(struct render *r, struct val self, const struct mcall *call, struct val *out)
{
    struct val a = chat_v_none();
    bool res;
    if (!marg(call, 0, NULL, &a))
        return chat_rerr(r, TDM_EINVAL, "%s() takes at least 1 argument", call->m);
    size_t b0, b1;
    int64_t cp0, cps;
    if (str_window(r, self, call->args, call->names, call->nargs, call->m, &b0, &b1, &cp0, &cps) !=
            TDM_OK ||
        prefix_test(r, self, b0, b1, cps, a, M("endswith"), &res) != TDM_OK)
        return r->rc;
    *out = chat_v_bool(res);
    return TDM_OK;
}

static int s_split(struct render *r, struct val self, const struct mcall *call, struct val *out)
{
    struct val a = chat_v_none();
    marg(call, 0, "sep", &a);
    struct val ms = chat_v_int(-1);
    marg(call, 1, "maxsplit", &ms);
    int64_t maxsplit = -1;
    if (need_int(r, ms, call->m, &maxsplit) != TDM_OK)
        return r->rc;
    return do_split(r, self, a, maxsplit, M("rsplit"), out);
}

static int s_strip(struct render *r, struct val self, const struct mcall *call, struct val *out)
{
    struct val a = chat_v_none();
    marg(call, 0, "chars", &a);
    return do_strip(r, self, a, !M("rstrip"), !M("lstrip"), out);
}

static int s_case(struct render *r, struct val self, const struct mcall *call, struct val *out)
{
    return map_case(r, self,
                    M("upper")        ? 0
                    : M("lower")      ? 1
                    : M("capitalize") ? 2
                    : M("title")      ? 3
                                      : 4,
                    out);
}

static int s_replace(struct render *r, struct val self, const struct mcall *call, struct val *out)
{
    struct val a = chat_v_none();
    struct val b = chat_v_none();
    struct val count = chat_v_int(-1);
    if (!marg(call, 0, NULL, &a) || !marg(call, 1, NULL, &b))
        return chat_rerr(r, TDM_EINVAL, "replace() needs old and new");
    marg(call, 2, "count", &count);
    int64_t c = -1;
    if (need_int(r, count, "replace", &c) != TDM_OK)
        return r->rc;
    return do_replace(r, self, a, b, c, out);
}

static int s_join(struct render *r, struct val self, const struct mcall *call, struct val *out)
{
    struct val a = chat_v_none();
    struct val items;
    if (!marg(call, 0, NULL, &a) || chat_v_iterate(r, a, &items) != TDM_OK)
        return chat_rerr(r, TDM_EINVAL, "join() needs an iterable");
    struct tdm_strbuf bb = {.limit = CHAT_MAX_STRING};
    for (size_t i = 0; i < items.u.list->n; i++) {
        struct val it = items.u.list->items[i];
        if (it.kind != V_STR) {
            free(bb.p);
            return chat_rerr(r, TDM_EINVAL, "sequence item %zu: expected str instance, %s found", i,
                             chat_v_type_name(it));
        }
        if (i)
            tdm_strbuf_add(&bb, self.u.str.s, self.u.str.n);
        tdm_strbuf_add(&bb, it.u.str.s, it.u.str.n);
    }
    int rc = chat_sb_to_val(r, &bb, out);
    free(bb.p);
    return rc;
}

static int s_find(struct render *r, struct val self, const struct mcall *call, struct val *out)
{
    struct val a = chat_v_none();
    if (!marg(call, 0, NULL, &a) || need_str(r, a, call->m) != TDM_OK)
        return chat_rerr(r, TDM_EINVAL, "%s() needs a string", call->m);
    size_t b0, b1;
    int64_t cp0, cps;
    if (str_window(r, self, call->args, call->names, call->nargs, call->m, &b0, &b1, &cp0, &cps) !=
        TDM_OK)
        return r->rc;
    const char *h = self.u.str.s + b0;
    size_t hn = b1 - b0;
    bool fits = cps >= 0 && a.u.str.n <= hn; // else no match at all (CPython's early out)
    if (M("count")) {
        int64_t c = 0;
        if (!fits) {
            c = 0;
        } else if (a.u.str.n == 0) {
            c = cps + 1;
        } else {
            for (const char *p = h;
                 (p = find_bytes(p, hn - (size_t)(p - h), a.u.str.s, a.u.str.n)) != NULL;
                 p += a.u.str.n)
                c++;
        }
        *out = chat_v_int(c);
        return TDM_OK;
    }
    const char *hit = NULL;
    if (!fits) {
        hit = NULL;
    } else if (M("find") || M("index")) {
        hit = find_bytes(h, hn, a.u.str.s, a.u.str.n);
    } else {
        for (const char *p = h;
             (p = find_bytes(p, hn - (size_t)(p - h), a.u.str.s, a.u.str.n)) != NULL; p++) {
            hit = p;
            if (p == h + hn)
                break;
        }
    }
    if (!hit && (M("index") || M("rindex")))
        return chat_rerr(r, TDM_EINVAL, "substring not found");
    *out = chat_v_int(hit ? cp0 + (int64_t)chat_utf8_len(h, (size_t)(hit - h)) : -1);
    return TDM_OK;
}

static int s_splitlines(struct render *r, struct val self, const struct mcall *call,
                        struct val *out)
{
    struct val keep = chat_v_bool(false);
    marg(call, 0, "keepends", &keep);
    return do_splitlines(r, self, chat_v_truthy(keep), out);
}

static int s_remove(struct render *r, struct val self, const struct mcall *call, struct val *out)
{
    struct val a = chat_v_none();
    bool res;
    if (!marg(call, 0, NULL, &a) || need_str(r, a, call->m) != TDM_OK)
        return chat_rerr(r, TDM_EINVAL, "%s() needs a string", call->m);
    bool end = M("removesuffix");
    if (prefix_test(r, self, 0, self.u.str.n, 0, a, end, &res) != TDM_OK)
        return r->rc;
    *out = self;
    if (res) {
        out->u.str.n -= a.u.str.n;
        if (!end)
            out->u.str.s += a.u.str.n;
    }
    return TDM_OK;
}

static int s_is(struct render *r, struct val self, const struct mcall *call, struct val *out)
{
    (void)r;
    bool ok = self.u.str.n > 0, cased = false;
    for (size_t i = 0; i < self.u.str.n; i++) {
        char c = self.u.str.s[i];
        bool d = c >= '0' && c <= '9', al = ascii_alpha(c);
        if (M("isdigit"))
            ok &= d;
        else if (M("isalpha"))
            ok &= al;
        else if (M("isalnum"))
            ok &= d || al;
        else if (M("isspace"))
            ok &= c == ' ' || (c >= 9 && c <= 13);
        else if (al) {
            cased = true;
            ok &= M("islower") ? (c >= 'a' && c <= 'z') : (c >= 'A' && c <= 'Z');
        }
    }
    if (M("islower") || M("isupper"))
        ok = ok && cased;
    *out = chat_v_bool(ok);
    return TDM_OK;
}
#undef M

// Python's str methods the renderer has, by name (sorted: bsearch).
static const struct str_method_entry {
    const char *name;
    int (*fn)(struct render *r, struct val self, const struct mcall *call, struct val *out);
} str_method_table[] = {
    {"capitalize", s_case},
    {"count", s_find},
    {"endswith", s_prefix},
    {"find", s_find},
    {"index", s_find},
    {"isalnum", s_is},
    {"isalpha", s_is},
    {"isdigit", s_is},
    {"islower", s_is},
    {"isspace", s_is},
    {"isupper", s_is},
    {"join", s_join},
    {"lower", s_case},
    {"lstrip", s_strip},
    {"removeprefix", s_remove},
    {"removesuffix", s_remove},
    {"replace", s_replace},
    {"rfind", s_find},
    {"rindex", s_find},
    {"rsplit", s_split},
    {"rstrip", s_strip},
    {"split", s_split},
    {"splitlines", s_splitlines},
    {"startswith", s_prefix},
    {"strip", s_strip},
    {"swapcase", s_case},
    {"title", s_case},
    {"upper", s_case},
};

static int cmp_method(const void *key, const void *e)
{
    return strcmp(key, ((const struct str_method_entry *)e)->name);
}

static int str_method(struct render *r, struct val self, const char *m, const struct val *args,
                      const char *const *names, size_t nargs, struct val *out)
{
    const struct str_method_entry *e =
        bsearch(m, str_method_table, sizeof str_method_table / sizeof *str_method_table,
                sizeof *str_method_table, cmp_method);
    if (e == NULL)
        return chat_rerr(r, TDM_EINVAL, "str.%s() is not supported by this renderer", m);
    const struct mcall call = {m, args, names, nargs};
    return e->fn(r, self, &call, out);
}

static int dict_method(struct render *r, struct val self, const char *m, const struct val *args,
                       const char *const *names, size_t nargs, struct val *out)
{
    struct vdict *d = self.u.dict;
    if (strcmp(m, "get") == 0) {
        struct val key, def = chat_v_none();
        if (!arg(args, names, nargs, 0, NULL, &key))
            return chat_rerr(r, TDM_EINVAL, "get expected at least 1 argument, got 0");
        arg(args, names, nargs, 1, NULL, &def);
        if (!chat_v_dict_find(d, key, out))
            *out = def;
        return TDM_OK;
    }
    if (strcmp(m, "items") == 0) {
        if (chat_builtin_filter(r, F_ITEMS, self, NULL, NULL, 0, out) != TDM_OK)
            return r->rc;
        out->u.list->gen = false;
        out->u.list->view = true;
        return TDM_OK;
    }
    if (strcmp(m, "keys") == 0 || strcmp(m, "values") == 0) {
        bool keys = m[0] == 'k';
        if (chat_v_list_new(r, d->n, out) != TDM_OK)
            return r->rc;
        for (size_t i = 0; i < d->n; i++)
            chat_v_list_push(r, out->u.list, keys ? d->keys[i] : d->vals[i]);
        out->u.list->view = true;
        return r->rc;
    }
    if (strcmp(m, "copy") == 0) {
        if (chat_v_dict_new(r, out) != TDM_OK)
            return r->rc;
        for (size_t i = 0; i < d->n; i++)
            if (chat_v_dict_set(r, out->u.dict, d->keys[i], d->vals[i]) != TDM_OK)
                return r->rc;
        return TDM_OK;
    }
    // pop, update, clear, setdefault, popitem: Jinja's immutable sandbox refuses them.
    return chat_rerr(r, TDM_EINVAL, "dict.%s() is not allowed (the template sandbox is immutable)",
                     m);
}

int chat_builtin_call(struct render *r, struct val fn, const struct val *args,
                      const char *const *names, size_t nargs, struct val *out)
{
    if (!chat_charge(r, 1))
        return r->rc;
    if (fn.kind == V_FUNC)
        return call_global(r, fn.u.func, args, names, nargs, out);
    struct val self = *fn.u.method.self;
    const char *m = fn.u.method.name;
    switch (self.kind) {
    case V_STR:
        return str_method(r, self, m, args, names, nargs, out);
    case V_DICT:
        return dict_method(r, self, m, args, names, nargs, out);
    case V_LOOP:
        if (nargs == 0)
            return chat_rerr(r, TDM_EINVAL, "no items for cycling given");
        *out = args[self.u.loop->index0 % (int64_t)nargs];
        return TDM_OK;
    case V_LIST:
        if (strcmp(m, "count") == 0 || strcmp(m, "index") == 0) {
            if (nargs != 1)
                return chat_rerr(r, TDM_EINVAL, "list.%s() takes exactly one argument", m);
            int64_t c = 0, first = -1;
            for (size_t i = 0; i < self.u.list->n; i++)
                if (chat_v_equal(self.u.list->items[i], args[0])) {
                    c++;
                    if (first < 0)
                        first = (int64_t)i;
                }
            if (m[0] == 'i' && first < 0)
                return chat_rerr(r, TDM_EINVAL, "list.index(x): x not in list");
            *out = chat_v_int(m[0] == 'c' ? c : first);
            return TDM_OK;
        }
        if (strcmp(m, "copy") == 0)
            return chat_builtin_filter(r, F_LIST, self, NULL, NULL, 0, out);
        return chat_rerr(r, TDM_EINVAL,
                         "list.%s() is not allowed (the template sandbox is immutable)", m);
    default:
        return chat_rerr(r, TDM_EINVAL, "cannot call a method of %s", chat_v_type_name(self));
    }
}
