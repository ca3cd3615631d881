/* check_run.h - run one Check suite and turn its result into an exit status. */
#ifndef SCAPE_CHECK_RUN_H
#define SCAPE_CHECK_RUN_H
#include <check.h>
#include <stdlib.h>

static inline int check_run(Suite *s)
{
    SRunner *sr = srunner_create(s);
    srunner_run_all(sr, CK_NORMAL);
    int failed = srunner_ntests_failed(sr);
    srunner_free(sr);
    return failed ? EXIT_FAILURE : EXIT_SUCCESS;
}

#endif /* SCAPE_CHECK_RUN_H */
