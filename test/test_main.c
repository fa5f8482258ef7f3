// test_main.c — the CPU suite: runs every test group (test.h's harness, test/test_harness.c) and
// prints the closing line "N passed, M failed".
#include "test.h"
#include <stdlib.h>

int main(void) {
    if (getenv("BNB8_TEST_CHILD")) return test_faults_child();
    printf("bnb8 CPU tests, TEST_SEED=%llu\n", (unsigned long long)test_seed());
    tests_threads();   // first: the process's first save is made by several threads at once
    tests_quant();
    tests_optim();
    tests_train();
    tests_state();
    tests_faults();
    tests_flash();
    tests_guard();
    tests_shard();
    tests_resume();
    tests_export();
    tests_messages();
    tests_api();
    tests_llmc_adapter();
    tests_round();
    tests_four();
    return test_summary();
}
