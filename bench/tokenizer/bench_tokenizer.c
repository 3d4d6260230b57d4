// SPDX-License-Identifier: Apache-2.0
// tandem-bench-tokenizer: encode throughput on one core for three corpora:
// English prose (the GPL-3 text Debian ships, or a built-in paragraph), CJK
// prose (sentences written below) and C code (this repository's own sources).
// Each corpus is encoded whole, repeatedly for at least half a second after a
// warm-up pass (so the word cache is in its steady state, as in a server), and
// the line ends with the ratio to the 5 MB/s goal.
//   tandem-bench-tokenizer [MODEL_DIR]   (default: ../shared/models/qwen2-tokenizer
//                                         next to the source tree)
#include "core.h"
#include "tokenizer.h"

#include <dirent.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#define GOAL_MB_S 5.0
#define TARGET_BYTES (1u << 20) // corpora are repeated up to about 1 MiB

static const char english_fallback[] =
    "The licenses for most software and other practical works are designed to take away your "
    "freedom to share and change the works. By contrast, the General Public License is intended "
    "to guarantee your freedom to share and change all versions of a program, to make sure it "
    "remains free software for all its users. When we speak of free software, we are referring "
    "to freedom, not price. Our General Public Licenses are designed to make sure that you have "
    "the freedom to distribute copies of free software (and charge for them if you wish), that "
    "you receive source code or can get it if you want it, that you can change the software or "
    "use pieces of it in new free programs, and that you know you can do these things.\n\n";

static const char cjk_text[] =
    "今天早上天气很好，我和朋友一起去公园散步。公园里有很多人在锻炼身体，有的在跑步，有的在打太极拳"
    "。"
    "湖边的柳树已经发芽了，春天真的来了。我们在长椅上坐了一会儿，聊起了小时候的事情。\n"
    "机器学习是人工智能的一个重要分支，它让计算机能够从数据中自动学习规律，而不需要明确的编程。"
    "近年来，大型语言模型的发展非常迅速，已经被广泛应用于翻译、写作和编程等领域。\n"
    "東京は日本の首都であり、世界でも有数の大都市です。毎日多くの人が電車で通勤しています。"
    "春には桜が咲き、多くの人々が公園で花見を楽しみます。\n"
    "서울은 한국의 수도이며 인구가 천만 명에 가까운 큰 도시입니다. 한강이 도시를 가로질러 흐르고 "
    "있습니다.\n"
    "这个服务器每秒可以处理数千个请求，延迟保持在几十毫秒以内。为了提高吞吐量，我们把预填充和解码分"
    "开部署。\n";

struct corpus {
    char *text;
    size_t len;
};

static int append(struct corpus *c, size_t *cap, const char *s, size_t n)
{
    if (tdm_grow(&c->text, cap, c->len + n + 1, 1, 4096) != TDM_OK)
        return TDM_ENOMEM;
    memcpy(c->text + c->len, s, n);
    c->len += n;
    c->text[c->len] = 0;
    return TDM_OK;
}

static int repeat_to_target(struct corpus *c, const char *unit, size_t n)
{
    size_t cap = 0;
    c->text = NULL;
    c->len = 0;
    while (c->len < TARGET_BYTES)
        if (append(c, &cap, unit, n))
            return TDM_ENOMEM;
    return TDM_OK;
}

// Appends every .c and .h file under dir, recursively, until the target size.
static void collect_sources(struct corpus *c, size_t *cap, const char *dir)
{
    DIR *d = opendir(dir);
    if (!d)
        return;
    struct dirent *e;
    while ((e = readdir(d)) && c->len < TARGET_BYTES) {
        if (e->d_name[0] == '.' || strncmp(e->d_name, "build", 5) == 0)
            continue;
        char *path = tdm_path_join(dir, e->d_name);
        struct stat st;
        if (!path || stat(path, &st) != 0) {
            free(path);
            continue;
        }
        size_t nl = strlen(e->d_name);
        if (S_ISDIR(st.st_mode)) {
            collect_sources(c, cap, path);
        } else if (nl > 2 && (strcmp(e->d_name + nl - 2, ".c") == 0 ||
                              strcmp(e->d_name + nl - 2, ".h") == 0)) {
            char *text;
            size_t len;
            if (tdm_read_file(path, &text, &len, NULL, 0) == TDM_OK) {
                append(c, cap, text, len);
                free(text);
            }
        }
        free(path);
    }
    closedir(d);
}

static int bench_one(const struct tdm_tokenizer *tok, const char *name, const struct corpus *c)
{
    int32_t *ids;
    size_t n;
    int rc = tdm_tok_encode(tok, c->text, c->len, false, &ids, &n); // warm-up
    if (rc)
        return rc;
    free(ids);
    double t0 = tdm_now(), t;
    size_t bytes = 0, runs = 0;
    do {
        if ((rc = tdm_tok_encode(tok, c->text, c->len, false, &ids, &n)))
            return rc;
        free(ids);
        bytes += c->len;
        runs++;
        t = tdm_now() - t0;
    } while (t < 0.5);
    double mb_s = (double)bytes / t / 1e6;
    printf(
        "%-8s %8.2f MB/s  %5.2f bytes/token  %zu bytes x %zu runs  ratio to %.0f MB/s goal: %.2f\n",
        name, mb_s, (double)c->len / (double)(n ? n : 1), c->len, runs, GOAL_MB_S,
        mb_s / GOAL_MB_S);
    return TDM_OK;
}

static const struct tdm_flags bench_table = {
    .usage = "usage: tandem-bench-tokenizer [MODEL_DIR]\n"
             "  MODEL_DIR                     folder with tokenizer.json (default: the shared\n"
             "                                Qwen2 tokenizer)\n",
};

int main(int argc, char **argv)
{
    char *rest[1];
    int n_rest = 0, exit_code = 0;
    if (tdm_flags_main(&bench_table, NULL, argc, argv, rest, 1, &n_rest, "tandem-bench-tokenizer",
                       &exit_code))
        return exit_code;
    const char *dir = n_rest > 0 ? rest[0] : TANDEM_SOURCE_DIR "/../shared/models/qwen2-tokenizer";
    char err[512] = "";
    struct tdm_tokenizer *tok;
    double t0 = tdm_now();
    int rc = tdm_tok_load(&tok, dir, err, sizeof err);
    if (rc) {
        fprintf(stderr, "tandem-bench-tokenizer: %s: %s\n", tdm_strerror(rc), err);
        return 1;
    }
    printf("load     %8.3f s   (%s)\n", tdm_now() - t0, dir);

    struct corpus english = {0}, cjk = {0}, code = {0};
    char *gpl;
    size_t gpl_len;
    const char *english_src = "/usr/share/common-licenses/GPL-3";
    if (tdm_read_file(english_src, &gpl, &gpl_len, NULL, 0) == TDM_OK) {
        rc = repeat_to_target(&english, gpl, gpl_len);
        free(gpl);
    } else {
        english_src = "built-in paragraph";
        rc = repeat_to_target(&english, english_fallback, sizeof english_fallback - 1);
    }
    if (!rc)
        rc = repeat_to_target(&cjk, cjk_text, sizeof cjk_text - 1);
    size_t cap = 0;
    collect_sources(&code, &cap, TANDEM_SOURCE_DIR);
    if (!rc && code.len == 0)
        rc = append(&code, &cap, english_fallback, sizeof english_fallback - 1);
    if (rc)
        goto out;
    printf("english corpus: %s\n", english_src);
    if (!(rc = bench_one(tok, "english", &english)) && !(rc = bench_one(tok, "cjk", &cjk)))
        rc = bench_one(tok, "c-code", &code);
out:
    if (rc)
        fprintf(stderr, "tandem-bench-tokenizer: %s\n", tdm_strerror(rc));
    free(english.text);
    free(cjk.text);
    free(code.text);
    tdm_tok_free(tok);
    return rc ? 1 : 0;
}
