# Sourced by scripts/backed-memory and scripts/bench-pair: holds back this VM's free
# page reporting (virtio-balloon), so pages the guest frees stay backed by the host
# and a benchmark's page-cache writes do not pay the host's first-touch fault
# (~1-2 CPU-s/GiB here; a bare-metal node does not pay it). BENCHMARKS.md, issue 11.
#
# `page_reporting_order` is the smallest free block the kernel reports; the largest
# value it accepts is one past its largest order, which reports nothing, for as long
# as it is set. Kernels without that knob get `min_free_ms` at its 60 s maximum, which
# holds pages back only for the first minute.
#
# hold_page_reporting: prints what it did; sets PAGE_REPORTING_RESTORE to a command
# that puts the old value back (empty when nothing was changed). Needs root.
PAGE_REPORTING_DIR=/sys/module/page_reporting/parameters
PAGE_REPORTING_RESTORE=""
hold_page_reporting() {
  local order="$PAGE_REPORTING_DIR/page_reporting_order"
  local delay="$PAGE_REPORTING_DIR/min_free_ms"
  if [ -w "$order" ]; then
    local was v
    was=$(cat "$order")
    for v in 16 15 14 13 12 11 10; do
      if [ "$v" -gt "$was" ] && (echo "$v" >"$order") 2>/dev/null; then
        PAGE_REPORTING_RESTORE="echo $was >$order"
        echo "page reporting held: page_reporting_order $v (was $was) until exit" >&2
        return 0
      fi
    done
  fi
  if [ -w "$delay" ]; then
    PAGE_REPORTING_RESTORE="echo $(cat "$delay") >$delay"
    echo 60000 >"$delay"
    echo "page reporting held: min_free_ms 60000 (its maximum: the first minute only)" >&2
    return 0
  fi
  echo "page reporting: no writable knob under $PAGE_REPORTING_DIR; nothing held" >&2
}
restore_page_reporting() {
  if [ -n "$PAGE_REPORTING_RESTORE" ]; then
    sh -c "$PAGE_REPORTING_RESTORE"
    PAGE_REPORTING_RESTORE=""
  fi
}
