// nkey.c — `pdserve nkey-gen --out FILE`: a NATS nkey user key pair for the control plane's NATS
// authentication (control/nkey.h). The seed goes to FILE (mode 0600, never overwritten); the
// public key, which nats-server's configuration lists (authorization { users = [ { nkey: U... } ] }),
// is printed on stdout.
#include <getopt.h>
#include <stdio.h>
#include <string.h>

#include "cmd/cmd.h"
#include "control/nkey.h"

static void usage(void) {
    printf("usage: pdserve nkey-gen --out FILE\n"
           "  writes a fresh NATS nkey user seed to FILE (mode 0600; an existing FILE is an error) and prints\n"
           "  its public key (U...), for nats-server's `authorization { users = [ { nkey: U... } ] }`;\n"
           "  give FILE to serve/router as --control-nkey-seed\n"
           "  --public-of FILE   print the public key of an existing seed file instead\n");
}

int pd_cmd_nkey_gen(int argc, char **argv) {
    enum { O_OUT = 1, O_PUB, O_HELP };
    static const struct option opts[] = {
        {"out", required_argument, 0, O_OUT}, {"public-of", required_argument, 0, O_PUB}, {"help", no_argument, 0, O_HELP}, {0, 0, 0, 0}};
    const char *out = NULL, *pub_of = NULL;
    int c;
    optind = 1;
    while ((c = getopt_long(argc, argv, "", opts, NULL)) != -1) {
        switch (c) {
            case O_OUT: out = optarg; break;
            case O_PUB: pub_of = optarg; break;
            case O_HELP: usage(); return 0;
            default: return pd_cmd_usage_error("nkey-gen", "unknown option");
        }
    }
    if (optind < argc) return pd_cmd_usage_error("nkey-gen", "unexpected argument '%s'", argv[optind]);
    if (!out == !pub_of) return pd_cmd_usage_error("nkey-gen", "give exactly one of --out FILE and --public-of FILE");
    char seed[PD_NKEY_SEED_LEN + 1], pub[PD_NKEY_PUB_LEN + 1];
    pd_err err = {0};
    pd_status st = pub_of ? pd_nkey_read_seed_file(pub_of, seed, pub, &err) : pd_nkey_generate(seed, pub, &err);
    if (st == PD_OK && out) st = pd_nkey_write_seed_file(out, seed, &err);
    memset(seed, 0, sizeof seed);
    if (st != PD_OK) {
        fprintf(stderr, "pdserve nkey-gen: %s\n", err.msg);
        return 1;
    }
    printf("%s\n", pub);
    return 0;
}
