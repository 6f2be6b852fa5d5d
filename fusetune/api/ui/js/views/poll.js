// Repeats an async refresh while the view is shown: the next run starts an interval after the last one ended,
// so a slow server is never asked twice at once. The refresh returns false to stop, or a number of
// milliseconds to wait before the next run instead of `intervalMs`. Returns a stop function.

export function poll(refresh, intervalMs) {
  let stopped = false;
  let timer = null;
  const run = async () => {
    if (stopped) return;
    let next = intervalMs;
    try {
      next = await refresh();
    } catch (error) {
      console.error(error);
    }
    if (stopped || next === false) return;
    timer = setTimeout(run, typeof next === "number" ? next : intervalMs);
  };
  run();
  return () => {
    stopped = true;
    clearTimeout(timer);
  };
}
