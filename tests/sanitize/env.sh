# Sourced by tests/run.sh before it runs the sanitizer build (build-san).
# Every option and suppression says why it is there:
#  - halt_on_error, exitcode 86/87: a finding stops the program with a status
#    no test expects (the bad-input catalogue also looks for the report).
#  - detect_leaks=1: a leak is a finding too.
#  - allocator_may_return_null=1: mnemo checks every allocation and turns a
#    failure into "out of memory allocating N bytes"; the catalogue asks for
#    64 GiB and 4e18 bytes on purpose to see that message. ASan's default
#    would abort there instead of returning NULL as malloc does.
#  - UBSan prints a stack trace so a finding names its line.
#  - the suppression files hold only findings in libraries this project does
#    not build, one line each with its reason.
SAN_SUPP="$PWD/tests/sanitize"
export ASAN_OPTIONS="halt_on_error=1:exitcode=86:detect_leaks=1:allocator_may_return_null=1"
export LSAN_OPTIONS="suppressions=$SAN_SUPP/lsan.supp:print_suppressions=0"
export UBSAN_OPTIONS="halt_on_error=1:exitcode=87:print_stacktrace=1:suppressions=$SAN_SUPP/ubsan.supp"
