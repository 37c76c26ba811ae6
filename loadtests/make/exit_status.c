/* A GNU make plugin with one function, $(exit-status N): make itself exits with status N.
 *
 * Why: GNU make exits 2 whenever a recipe fails, whatever the command's own status, but
 * `make gpu-check` must exit 77 (automake's "skipped") on a machine without CUDA, as
 * `python -m loadtests.gpu_check` does. The Makefile compiles this file with the system C
 * compiler and `-load`s it only for the gpu-check goal; without a compiler the recipe falls back
 * to make's own status (2, reporting "Error 77").
 *
 * The interface is GNU make's documented loadable-object API (make 4.0 and later). */
#include <stdlib.h>
#include <gnumake.h>

int plugin_is_GPL_compatible;

static char *exit_status(const char *name, unsigned int argc, char **argv)
{
    (void)name;
    (void)argc;
    fflush(NULL);
    exit(atoi(argv[0]));
}

int exit_status_gmk_setup(const gmk_floc *floc)
{
    (void)floc;
    gmk_add_function("exit-status", exit_status, 1, 1, GMK_FUNC_DEFAULT);
    return 1;
}
