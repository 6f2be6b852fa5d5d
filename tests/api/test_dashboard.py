"""The browser dashboard (/ui) in headless Chromium against a running service: one finished demo job and one
that trains until the test cancels it from the page.

Every wait is on something the test can read (a metrics row through the API, an element, a file), never on a
sleep that assumes a speed. Chromium and chromedriver come from Debian's packages (.ci/run installs them); with
FUSETUNE_TEST_REQUIRE_SERVICES=1 (CI) a missing browser fails these tests instead of skipping them.
"""

from __future__ import annotations

import io
import os
import shutil
import socket
import subprocess
import sys
import tarfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from fusetune.demo.assets import PREFERENCE_FILE, TRAIN_FILE, VALID_FILE, build_tiny_model
from tests.services import Service, running_service, service_env, skip_or_fail

pytestmark = pytest.mark.slow

MODEL = "tiny-llama"
REPO = Path(__file__).resolve().parents[2]
# The README's screenshot of the job page, written only when asked (FUSETUNE_UPDATE_SCREENSHOT=1), so that a
# test run leaves the checkout as it found it.
SCREENSHOT = REPO / "docs" / "dashboard.png"
WAIT_S = 600  # an upper bound for a busy machine; every wait ends as soon as its condition holds
# The finished job: 3 epochs of 32 examples in batches of 8, 12 steps.
TRAIN_EXAMPLES, EPOCHS, BATCH_SIZE = 32, 3, 8
CHROMIUM_FLAGS = (
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-dev-shm-usage",
    # Without these Chromium tries the network (QUIC, component updates, sync) and can hang offline.
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
)


# ---- fixtures ----------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def browser(tmp_path_factory) -> Iterator[Any]:
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    chromedriver = shutil.which("chromedriver")
    if chromium is None or chromedriver is None:
        skip_or_fail("chromium and chromium-driver are not installed (.ci/run installs them)")
    try:
        from selenium import webdriver
        from selenium.webdriver.chrome.service import Service as DriverService
    except ImportError:
        skip_or_fail("selenium is not installed (pip install -e '.[dev]')")
    downloads = tmp_path_factory.mktemp("downloads")
    options = webdriver.ChromeOptions()
    options.binary_location = chromium
    for flag in CHROMIUM_FLAGS:
        options.add_argument(flag)
    options.add_argument(f"--user-data-dir={tmp_path_factory.mktemp('chromium-profile')}")
    options.add_argument("--window-size=1400,1000")
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    options.add_experimental_option(
        "prefs", {"download.default_directory": str(downloads), "download.prompt_for_download": False}
    )
    driver = webdriver.Chrome(options=options, service=DriverService(chromedriver))
    driver.execute_cdp_cmd(
        "Browser.setDownloadBehavior", {"behavior": "allow", "downloadPath": str(downloads)}
    )
    driver.download_dir = downloads
    try:
        yield driver
    finally:
        driver.quit()


def _subset(path: Path, lines: int, target: Path) -> Path:
    target.write_text("".join(path.read_text().splitlines(keepends=True)[:lines]))
    return target


def _create_job(service: Service, training: str, validation: str | None, **hyperparameters) -> dict:
    body = {"model": MODEL, "training_file": training, "seed": 0,
            "hyperparameters": {"batch_size": BATCH_SIZE, "learning_rate": 3e-3, "n_gpus": 1, **hyperparameters}}  # fmt: skip
    if validation:
        body["validation_file"] = validation
    response = service.client.post("/v1/fine_tuning/jobs", json=body)
    assert response.status_code == 200, response.text
    return response.json()


class Demo:
    """The service, its two jobs and the files they train on."""

    def __init__(self, service: Service, finished: dict, running: dict, training_file: str):
        self.service = service
        self.finished = finished
        self.running = running
        self.training_file = training_file


@pytest.fixture(scope="module")
def demo(tmp_path_factory) -> Iterator[Demo]:
    root = tmp_path_factory.mktemp("dashboard")
    data_dir = root / "data"
    (data_dir / "models").mkdir(parents=True)
    build_tiny_model(data_dir / "models" / MODEL)
    with running_service(data_dir) as service:
        training = service.upload(_subset(TRAIN_FILE, TRAIN_EXAMPLES, root / "train.jsonl")).json()["id"]
        validation = service.upload(_subset(VALID_FILE, 8, root / "valid.jsonl")).json()["id"]
        # Two ranks (gloo), so that the page has two ranks' memory to show.
        finished = _create_job(service, training, validation, n_epochs=EPOCHS, n_gpus=2)
        finished = service.wait_for_job(finished["id"], timeout_s=WAIT_S)
        assert finished["status"] == "succeeded", finished
        # The worker takes one job at a time, so this one starts once the first is done. 100 epochs of the whole
        # demo set (6,400 steps) cannot finish before the last test cancels it.
        everything = service.upload(TRAIN_FILE).json()["id"]
        running = _create_job(service, everything, None, n_epochs=100)
        _wait_for(lambda: len(_api_steps(service, running["id"])) >= 1, "the running job's first step")
        yield Demo(service, finished, running, training)
        service.client.post(f"/v1/fine_tuning/jobs/{running['id']}/cancel")


@pytest.fixture
def dashboard(browser, demo):
    """The browser, signed in with the demo service's key; the test fails on any script error or blocked load."""
    _sign_in(browser, demo.service, demo.service.api_key)
    browser.get_log("browser")  # start from an empty console
    yield browser
    assert _console_errors(browser) == []


def _console_errors(driver) -> list[str]:
    # A refused request (401, 404) is logged by the browser itself; the page shows it, which the tests check.
    return [
        entry["message"]
        for entry in driver.get_log("browser")
        if entry["level"] == "SEVERE" and "Failed to load resource" not in entry["message"]
    ]


# ---- helpers -------------------------------------------------------------------------------------------------


def _wait_for(condition: Callable[[], Any], what: str, timeout_s: float = WAIT_S) -> Any:
    from selenium.common.exceptions import NoSuchElementException, StaleElementReferenceException

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            value = condition()
        except (NoSuchElementException, StaleElementReferenceException):
            value = None  # the page redrew that part between finding and reading it
        if value:
            return value
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


def _api_steps(service: Service, job_id: str) -> list[int]:
    """Every reported step of the job, read through the metrics endpoint's pages."""
    steps: list[int] = []
    while True:
        page = service.client.get(
            f"/v1/fine_tuning/jobs/{job_id}/metrics", params={"min_step": len(steps) and steps[-1] + 1}
        )
        page = page.json()
        steps += [point["step"] for point in page["data"]]
        if not page["has_more"]:
            return steps


def _sign_in(driver, service: Service, key: str, route: str = "#/jobs") -> None:
    from selenium.webdriver.common.by import By

    driver.get(f"{service.base_url}/ui/{route}")
    driver.execute_script("window.sessionStorage.clear()")
    driver.refresh()
    field = _element(driver, "#api-key")
    field.send_keys(key)
    driver.find_element(By.CSS_SELECTOR, "#sign-in button[type=submit]").click()
    _wait_for(lambda: driver.find_element(By.ID, "nav").is_displayed(), "the signed-in dashboard")
    assert key not in driver.current_url


def _element(driver, selector: str):
    from selenium.webdriver.common.by import By

    def find():
        found = driver.find_elements(By.CSS_SELECTOR, selector)
        return found[0] if found else None

    return _wait_for(find, f"element {selector}")


def _text(driver, selector: str) -> str:
    """The element's text once it exists, read in one step (the page redraws parts of itself as data arrives)."""
    return _wait_for(
        lambda: driver.execute_script(
            "const e = document.querySelector(arguments[0]); return e && e.innerText;", selector
        ),
        f"text of {selector}",
    )


def _chart_steps(driver, name: str = "loss") -> list[int] | None:
    return driver.execute_script(
        "const chart = document.querySelector(`[data-chart='${arguments[0]}']`);"
        "return chart && chart.uplot ? Array.from(chart.uplot.data[0]) : null;",
        name,
    )


def _listed_jobs(driver) -> dict[str, str]:
    return driver.execute_script(
        "return Object.fromEntries(Array.from(document.querySelectorAll('#jobs-table tbody tr'))"
        ".map(row => [row.dataset.jobId, row.dataset.status]));"
    )


# ---- tests ---------------------------------------------------------------------------------------------------


def test_a_wrong_key_shows_an_error_and_no_data(browser, demo):
    from selenium.webdriver.common.by import By

    browser.get_log("browser")
    browser.get(f"{demo.service.base_url}/")  # the root redirects to the dashboard
    assert browser.current_url.endswith("/ui/")
    browser.execute_script("window.sessionStorage.clear()")
    browser.refresh()
    _element(browser, "#api-key").send_keys("sk-not-a-key")
    browser.find_element(By.CSS_SELECTOR, "#sign-in button[type=submit]").click()
    assert "Invalid or revoked API key" in _text(browser, "#sign-in .error")
    assert not browser.find_element(By.ID, "nav").is_displayed()
    assert browser.find_elements(By.CSS_SELECTOR, "#jobs-table, [data-chart]") == []
    assert demo.finished["id"] not in browser.page_source
    assert browser.execute_script("return window.sessionStorage.length") == 0
    assert "sk-not-a-key" not in browser.current_url
    assert _console_errors(browser) == []


def test_jobs_list_shows_the_finished_and_the_running_job_with_filters(dashboard, demo):
    from selenium.webdriver.common.by import By

    browser = dashboard
    finished, running = demo.finished["id"], demo.running["id"]
    listed = _wait_for(lambda: (jobs := _listed_jobs(browser)) and len(jobs) >= 2 and jobs, "the jobs list")
    assert listed[finished] == "succeeded" and listed[running] == "running"
    row = _text(browser, f"#jobs-table tr[data-job-id='{finished}']")
    assert MODEL in row and "supervised" in row and f"{demo.finished['trained_tokens']:,}" in row
    for job_id in (finished, running):
        browser.find_element(
            By.CSS_SELECTOR, f"#jobs-table tr[data-job-id='{job_id}'] input[type=checkbox]"
        ).click()
    browser.find_element(By.ID, "compare-selected").click()
    assert browser.current_url.endswith(f"#/compare?jobs={finished},{running}")

    browser.get(f"{demo.service.base_url}/ui/#/jobs?status=running")
    _wait_for(lambda: _listed_jobs(browser) == {running: "running"}, "the status filter")
    assert _element(browser, "#filter-status").get_attribute("value") == "running"
    browser.get(f"{demo.service.base_url}/ui/#/jobs?model=no-such-model")
    _element(browser, "#jobs-empty")
    assert _listed_jobs(browser) == {}


def test_finished_job_page_plots_every_step_and_downloads_a_checkpoint(dashboard, demo, tmp_path):
    browser = dashboard
    from selenium.webdriver.common.by import By

    service, job = demo.service, demo.finished
    browser.get(f"{service.base_url}/ui/#/jobs/{job['id']}")
    metrics = service.client.get(f"/v1/fine_tuning/jobs/{job['id']}/metrics").json()["data"]
    assert len(metrics) == EPOCHS * TRAIN_EXAMPLES // BATCH_SIZE
    steps = [point["step"] for point in metrics]
    _wait_for(lambda: _chart_steps(browser) == steps, "one plotted point per reported step")
    plotted_loss = browser.execute_script(
        "return Array.from(document.querySelector(\"[data-chart='loss']\").uplot.data[1])"
    )
    assert plotted_loss == pytest.approx([point["train_loss"] for point in metrics])
    for chart in ("throughput", "memory", "accuracy"):
        assert _chart_steps(browser, chart) == steps
    # Each rank's memory peaks of the newest step, one line per node: both ranks ran on this host, node 0.
    ranks = metrics[-1]["rank_memory"]
    assert [(r["rank"], r["node"], r["host"]) for r in ranks] == [
        (0, 0, socket.gethostname()),
        (1, 0, socket.gethostname()),
    ]
    assert (
        max(r["peak_memory_allocated_bytes"] for r in ranks)
        == metrics[-1]["values"]["peak_memory_allocated_bytes"]
    )
    assert _text(browser, "#job-node-memory-step") == f"Step {steps[-1]}."
    node = "#job-node-memory tr[data-node='0']"
    assert len(browser.find_elements(By.CSS_SELECTOR, "#job-node-memory tbody tr")) == 1
    assert (_text(browser, f"{node} td.host"), _text(browser, f"{node} td.ranks")) == (
        socket.gethostname(),
        "0, 1",
    )
    shown = browser.execute_async_script(
        "const done = arguments[arguments.length - 1];"
        "import(arguments[1]).then(dom => done(arguments[0].map(dom.formatBytes)));",
        [r["peak_memory_allocated_bytes"] for r in ranks], f"{service.base_url}/ui/js/dom.js",
    )  # fmt: skip
    assert _text(browser, f"{node} td.per-rank") == f"0: {shown[0]} · 1: {shown[1]}"
    # Validation beside training: the whole validation file's loss and token accuracy at each epoch's end, as
    # points on the loss and accuracy charts, the same values the API reports.
    evaluated = [p["values"].get("valid_loss") is not None for p in metrics]
    assert sum(evaluated) == EPOCHS
    for chart, column, name in (("loss", 2, "valid_loss"), ("accuracy", 1, "train_mean_token_accuracy"),
                                ("accuracy", 2, "valid_mean_token_accuracy")):  # fmt: skip
        plotted = browser.execute_script(
            "return Array.from(document.querySelector(`[data-chart='${arguments[0]}']`).uplot.data[arguments[1]])",
            chart, column,
        )  # fmt: skip
        assert plotted == pytest.approx([p["values"].get(name) for p in metrics]), name
    # The checkpoints with OpenAI's metrics over the whole validation file; the results file; no ETA once done.
    listed = service.client.get(f"/v1/fine_tuning/jobs/{job['id']}/checkpoints").json()["data"]
    row = f"#job-checkpoints tr[data-checkpoint-id='{listed[0]['id']}']"
    valid_loss = listed[0]["metrics"]["full_valid_loss"]
    assert _wait_for(
        lambda: _text(browser, f"{row} td.valid-loss") == f"{valid_loss:.4g}", "checkpoint metrics"
    )
    accuracy = listed[0]["metrics"]["full_valid_mean_token_accuracy"]
    assert _text(browser, f"{row} td.valid-accuracy") == f"{accuracy * 100:.1f}%"
    assert _text(browser, "#job-result-files") == demo.finished["result_files"][0]
    assert _text(browser, "#job-eta") == "—"
    assert _element(browser, "#job-status").get_attribute("data-status") == "succeeded"
    assert _wait_for(lambda: "fp32" in _text(browser, "#job-precision"), "the precision")
    assert "n_epochs" in _text(browser, "#job-hyperparameters")
    # Every attempt with its cause, and the time trained over all of them (the job object's).
    assert _text(browser, "#job-attempts") == "1 succeeded"
    seconds = service.client.get(f"/v1/fine_tuning/jobs/{job['id']}").json()["training_seconds"]
    assert seconds is not None and _text(browser, "#job-training-time").endswith("s")
    events = _text(browser, "#job-events")
    assert "Training started" in events and "Step 1:" not in events  # per-step metrics events are left out
    assert [b.is_enabled() for b in browser.find_elements(By.CSS_SELECTOR, ".actions button")] == [False] * 3

    # The metrics module follows has_more pages: 5 points a page, 3 requests for 12 steps.
    paged = browser.execute_async_script(
        "const done = arguments[arguments.length - 1];"
        "import(arguments[1]).then(api => api.fetchMetricsFrom(arguments[0], 0, 5))"
        ".then(points => done(points.map(p => p.step)), error => done(String(error)));",
        job["id"], f"{service.base_url}/ui/js/api.js",
    )  # fmt: skip
    assert paged == steps

    checkpoint = service.client.get(f"/v1/fine_tuning/jobs/{job['id']}/checkpoints").json()["data"][0]
    _element(
        browser, f"button.download[data-checkpoint-id='{checkpoint['id']}'][data-training-state='false']"
    ).click()
    expected_name = f"{job['id']}-step-{checkpoint['step_number']}.tar"
    saved = browser.download_dir / expected_name
    _wait_for(lambda: saved.is_file() and not list(browser.download_dir.glob("*.crdownload")), "the download")
    url = f"/v1/fine_tuning/jobs/{job['id']}/checkpoints/{checkpoint['id']}/content"
    assert saved.read_bytes() == service.client.get(url).content
    with tarfile.open(fileobj=io.BytesIO(saved.read_bytes())) as tar:
        assert any(name.endswith("config.json") for name in tar.getnames())
    assert demo.service.api_key not in browser.page_source

    browser.set_window_size(1400, 1700)
    try:
        browser.execute_script("window.scrollTo(0, 0)")
        screenshot = (
            SCREENSHOT if os.environ.get("FUSETUNE_UPDATE_SCREENSHOT") == "1" else tmp_path / "page.png"
        )
        assert browser.save_screenshot(str(screenshot))
    finally:
        browser.set_window_size(1400, 1000)


def test_compare_view_overlays_the_jobs(dashboard, demo):
    browser = dashboard
    finished, running = demo.finished["id"], demo.running["id"]
    browser.get(f"{demo.service.base_url}/ui/#/compare?jobs={finished},{running}")
    finished_steps = _api_steps(demo.service, finished)
    # Two jobs' train and validation losses: four series on the union of their steps.
    _wait_for(lambda: set(finished_steps) <= set(_chart_steps(browser) or ()), "the finished job's curve")
    series = browser.execute_script(
        "return document.querySelector(\"[data-chart='loss']\").uplot.series.length"
    )
    assert series == 1 + 2 * 2
    rows = _text(browser, "#compare-table tbody")
    assert finished in rows and running in rows


def test_files_page_and_the_new_job_form_show_the_estimate_first(dashboard, demo, tmp_path):
    browser = dashboard
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import Select

    service = demo.service
    browser.get(f"{service.base_url}/ui/#/files")
    file = service.client.get(f"/v1/files/{demo.training_file}").json()
    row = _text(browser, f"#files-table tr[data-file-id='{demo.training_file}']")
    assert f"{file['example_count']:,}" in row and f"{file['token_estimate']:,}" in row and "valid" in row
    # An upload that fails the check shows the server's line-numbered problems and adds no file.
    files_before = len(browser.find_elements(By.CSS_SELECTOR, "#files-table tbody tr"))
    bad = tmp_path / "bad.jsonl"
    bad.write_text(TRAIN_FILE.read_text().splitlines()[0] + "\n{not json\n")
    browser.find_element(By.ID, "upload-file").send_keys(str(bad))
    browser.find_element(By.CSS_SELECTOR, "#upload-form button[type=submit]").click()
    assert "line 2: not valid JSON" in _text(browser, "#upload-result .error")
    assert len(browser.find_elements(By.CSS_SELECTOR, "#files-table tbody tr")) == files_before

    browser.get(f"{service.base_url}/ui/#/new")
    _wait_for(lambda: Select(_element(browser, "#training_file")).options, "the file choices")
    Select(browser.find_element(By.ID, "training_file")).select_by_value(demo.training_file)
    epochs = _element(browser, "#n_epochs")  # the hyperparameters' fields arrive with the server's options
    epochs.send_keys("2")
    body = {"model": MODEL, "training_file": demo.training_file, "dry_run": True,
            "hyperparameters": {"n_epochs": 2}}  # fmt: skip
    expected = service.client.post("/v1/fine_tuning/jobs", json=body).json()
    shown = lambda: browser.find_element(By.ID, "estimate-steps").text  # noqa: E731
    _wait_for(lambda: shown() == f"{expected['steps']:,}", "the estimate of 2 epochs")
    assert _text(browser, "#estimate-memory").endswith(("KiB", "MiB", "GiB"))
    _wait_for(lambda: browser.find_element(By.ID, "create-job").is_enabled(), "the enabled Create button")
    epochs.send_keys("0")  # 20 epochs: Create waits for the new estimate
    assert not browser.find_element(By.ID, "create-job").is_enabled()
    _wait_for(lambda: shown() == f"{expected['steps'] * 10:,}", "the estimate of 20 epochs")
    _wait_for(lambda: browser.find_element(By.ID, "create-job").is_enabled(), "the enabled Create button")
    browser.find_element(By.ID, "create-job").click()
    _wait_for(lambda: "#/jobs/ftjob-" in browser.current_url, "the new job's page")
    created = browser.current_url.rsplit("/", 1)[1]
    assert service.client.get(f"/v1/fine_tuning/jobs/{created}").json()["hyperparameters"]["n_epochs"] == 20
    assert service.client.post(f"/v1/fine_tuning/jobs/{created}/cancel").status_code == 200


def test_a_results_file_is_labelled_and_never_offered_for_training(dashboard, demo):
    """A finished job's results CSV is a file of the tenant's: the Files page says what each file is, and the new
    job form offers only training files of the chosen method's line format, so it opens on an estimate, never on
    the error a results file would get."""
    browser = dashboard
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import Select

    service = demo.service
    results = demo.finished["result_files"][0]
    preference = service.upload(PREFERENCE_FILE).json()["id"]
    browser.get(f"{service.base_url}/ui/#/files")
    row = lambda file: _text(browser, f"#files-table tr[data-file-id='{file}']")  # noqa: E731
    assert "a job's results" in row(results) and "not a training file" in row(results)
    assert "every line is a preference pair" in row(preference)
    assert "every line is a supervised example" in row(demo.training_file)
    assert "chat example" not in _text(browser, "#files-table")

    browser.get(f"{service.base_url}/ui/#/new")
    values = lambda select: [option.get_attribute("value") for option in select.options]  # noqa: E731
    files = lambda: values(Select(_element(browser, "#training_file")))  # noqa: E731
    _wait_for(lambda: demo.training_file in files(), "the training file among the choices")
    assert results not in files() and preference not in files()
    assert results not in values(Select(browser.find_element(By.ID, "validation_file")))
    assert _text(browser, "#estimate-steps")  # the newest usable file is estimated, not refused
    assert browser.find_elements(By.CSS_SELECTOR, "#estimate .error") == []
    Select(browser.find_element(By.ID, "method")).select_by_value("dpo")
    _wait_for(lambda: preference in files(), "the preference file among the DPO choices")
    assert demo.training_file not in files() and results not in files()


def test_the_new_job_form_is_built_from_the_options_and_sends_a_methods_settings(dashboard, demo):
    """The form's fields, defaults, bounds and choices are those of /v1/fine_tuning/options; DPO's own settings
    appear when DPO is chosen, and a DPO job created through the form has the beta typed into it."""
    browser = dashboard
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import Select

    service = demo.service
    options = service.client.get("/v1/fine_tuning/options").json()
    shared, dpo = options["hyperparameters"], options["methods"]["dpo"]["settings"]
    preference = service.upload(PREFERENCE_FILE).json()["id"]
    browser.get(f"{service.base_url}/ui/#/new")
    length = _element(browser, "#max_seq_length")  # the fields and the methods arrive with the options
    method = Select(browser.find_element(By.ID, "method"))
    values = lambda select: [option.get_attribute("value") for option in select.options]  # noqa: E731
    assert values(method) == list(options["methods"])
    assert method.first_selected_option.get_attribute("value") == options["default_method"]
    assert [length.get_attribute(a) for a in ("value", "min", "max")] == [
        str(shared["max_seq_length"][key]) for key in ("default", "minimum", "maximum")]  # fmt: skip
    assert _element(browser, "#n_epochs").get_attribute("placeholder") == "auto"
    assert values(Select(_element(browser, "#precision"))) == shared["precision"]["choices"]
    assert values(Select(_element(browser, "#lr_scheduler"))) == shared["lr_scheduler"]["choices"]
    # LoRA's own fields show while LoRA is ticked, with its defaults.
    rank = _element(browser, "#lora_r")
    assert not rank.is_displayed() and rank.get_attribute("value") == str(
        shared["lora"]["fields"]["r"]["default"]
    )
    _element(browser, "#lora").click()
    assert rank.is_displayed()
    _element(browser, "#lora").click()
    assert browser.find_elements(By.CSS_SELECTOR, "[id^='dpo_']") == []

    method.select_by_value("dpo")
    beta = _element(browser, "#dpo_beta")
    assert (
        beta.get_attribute("max") == str(dpo["beta"]["maximum"])
        and beta.get_attribute("placeholder") == "auto"
    )
    assert values(Select(_element(browser, "#dpo_loss_type"))) == ["auto", *dpo["loss_type"]["choices"]]
    assert not browser.find_element(By.ID, "packing").is_enabled()  # DPO does not pack
    files = Select(browser.find_element(By.ID, "training_file"))
    _wait_for(lambda: preference in values(files), "the preference file among the choices")
    files.select_by_value(preference)
    beta.send_keys("0.25")
    body = {"model": MODEL, "training_file": preference, "dry_run": True, "method": {"type": "dpo"}}
    expected = service.client.post("/v1/fine_tuning/jobs", json=body).json()
    _wait_for(lambda: _text(browser, "#estimate-steps") == f"{expected['steps']:,}", "the DPO estimate")
    _wait_for(lambda: browser.find_element(By.ID, "create-job").is_enabled(), "the enabled Create button")
    browser.find_element(By.ID, "create-job").click()
    _wait_for(lambda: "#/jobs/ftjob-" in browser.current_url, "the new job's page")
    created = service.client.get(f"/v1/fine_tuning/jobs/{browser.current_url.rsplit('/', 1)[1]}").json()
    assert created["method"]["type"] == "dpo" and created["method"]["dpo"]["hyperparameters"]["beta"] == 0.25
    assert service.client.post(f"/v1/fine_tuning/jobs/{created['id']}/cancel").status_code == 200


def test_the_new_job_form_previews_the_data_check_with_the_trained_tokens_highlighted(dashboard, demo):
    """The estimate shows the data check: the first example as the model sees it, its trained tokens highlighted;
    for a model whose chat template leaves the end-of-turn token untrained, the failed check and the example."""
    browser = dashboard
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import Select

    service = demo.service
    models_dir = service.settings.models_dir
    no_eot = models_dir / f"{MODEL}-no-eot"
    shutil.copytree(models_dir / MODEL, no_eot)
    template = (no_eot / "chat_template.jinja").read_text()
    # The end-of-turn token moved out of the generation block: rendered, never trained.
    moved = template.replace("{{- eos_token }}{%- endgeneration %}", "{%- endgeneration %}{{- eos_token }}")
    assert moved != template
    (no_eot / "chat_template.jinja").write_text(moved)
    try:
        browser.get(f"{service.base_url}/ui/#/new")
        models = lambda: [o.get_attribute("value") for o in Select(_element(browser, "#model")).options]  # noqa: E731
        _wait_for(lambda: no_eot.name in models(), "the model without a trained end-of-turn token")
        Select(browser.find_element(By.ID, "model")).select_by_value(MODEL)
        Select(browser.find_element(By.ID, "training_file")).select_by_value(demo.training_file)
        status = lambda: _element(browser, "#data-check").get_attribute("data-status")  # noqa: E731
        _wait_for(lambda: status() == "passed", "the passed data check")
        body = {"model": MODEL, "training_file": demo.training_file, "dry_run": True}
        preview = service.client.post("/v1/fine_tuning/jobs", json=body).json()["data_check"]["preview"]
        trained = [s["text"] for s in preview["sequences"][0]["segments"] if s["trained"]]

        def marks() -> list[str]:
            found = browser.find_elements(By.CSS_SELECTOR, "#data-check mark.trained")
            return [mark.get_attribute("textContent") for mark in found]

        assert marks() == trained and trained[0].endswith("<|eot|>")

        Select(browser.find_element(By.ID, "model")).select_by_value(no_eot.name)
        _wait_for(lambda: status() == "failed", "the failed data check")
        failure = _text(browser, "#data-check-failure")
        assert failure.startswith("end_of_turn_trained failed at training_file line 1: ")
        assert "would be refused" in _text(browser, "#data-check-status")
        assert marks() == [trained[0].removesuffix("<|eot|>")]  # the answer alone: its end never learnt
    finally:
        shutil.rmtree(no_eot)


def test_a_failed_jobs_status_updates_live_and_its_error_is_shown_plainly(dashboard, demo):
    from fusetune.db import queries
    from fusetune.db.session import make_engine, make_session_factory

    service = demo.service
    job = _create_job(service, demo.training_file, None, n_epochs=1)
    _wait_for(lambda: _listed_jobs(dashboard).get(job["id"]) == "queued", "the new job in the list")
    # Failed the way the worker fails a job (it is queued behind the running one, so no worker holds it).
    engine = make_engine(service.settings.database_url)
    with make_session_factory(engine)() as session:
        error = {"code": "out_of_memory", "message": "CUDA out of memory at step 3: use a smaller batch_size"}
        assert queries.finish_job_from(session, job["id"], "queued", "failed", error=error)
        session.commit()
    engine.dispose()
    # The list shows the new status without a reload.
    _wait_for(lambda: _listed_jobs(dashboard).get(job["id"]) == "failed", "the live status")
    dashboard.get(f"{service.base_url}/ui/#/jobs/{job['id']}")
    shown = _text(dashboard, "#job-error .error")
    assert "CUDA out of memory at step 3: use a smaller batch_size" in shown and "out_of_memory" in shown
    assert _element(dashboard, "#job-status").get_attribute("data-status") == "failed"


def test_a_tenant_sees_only_its_own_jobs(browser, demo):
    from selenium.webdriver.common.by import By

    service = demo.service
    created = subprocess.run(
        [sys.executable, "-m", "fusetune.cli", "keys", "create", "--tenant", "bob"],
        env=service_env(service.settings), capture_output=True, text=True, check=True,
    )  # fmt: skip
    bob_key = created.stdout.strip().split("\t")[-1]
    browser.get_log("browser")
    _sign_in(browser, service, bob_key)
    _element(browser, "#jobs-empty")
    assert _listed_jobs(browser) == {}
    assert demo.finished["id"] not in browser.page_source and demo.running["id"] not in browser.page_source

    browser.get(f"{service.base_url}/ui/#/jobs/{demo.finished['id']}")
    assert "No fine-tuning job with id" in _text(browser, "#job-page-error .error")
    assert _chart_steps(browser) in (None, [])
    assert browser.find_elements(By.CSS_SELECTOR, "#job-checkpoints tbody tr") == []
    browser.get(f"{service.base_url}/ui/#/compare?jobs={demo.finished['id']},{demo.running['id']}")
    _element(browser, "#compare-error .error")
    assert _chart_steps(browser) == []
    assert _console_errors(browser) == []


def test_running_job_chart_grows_and_cancel_works_from_the_page(dashboard, demo):
    browser = dashboard
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support import expected_conditions
    from selenium.webdriver.support.ui import WebDriverWait

    service, job_id = demo.service, demo.running["id"]
    browser.get(f"{service.base_url}/ui/#/jobs/{job_id}")
    _wait_for(lambda: _element(browser, "#job-status").get_attribute("data-status") == "running", "running")
    assert [browser.find_element(By.ID, f"job-{verb}").is_enabled() for verb in ("cancel", "pause", "resume")] == [
        True, True, False]  # fmt: skip
    reported = len(_api_steps(service, job_id))
    plotted = _wait_for(
        lambda: (s := _chart_steps(browser)) and len(s) >= reported and s, "the reported steps"
    )
    # The job reports more steps; the chart must follow without a reload.
    _wait_for(lambda: len(_api_steps(service, job_id)) > len(plotted), "another reported step")
    now_reported = _api_steps(service, job_id)
    grown = _wait_for(
        lambda: (s := _chart_steps(browser)) and len(s) >= len(now_reported) and s, "the chart growing"
    )
    assert len(grown) > len(plotted)
    assert grown == _api_steps(service, job_id)[: len(grown)]  # one point per reported step, none skipped
    # When it should end, from the job object's estimated_finish (the trainer's measured step times).
    assert service.client.get(f"/v1/fine_tuning/jobs/{job_id}").json()["estimated_finish"] is not None
    assert "in about" in _wait_for(lambda: (t := _text(browser, "#job-eta")) != "—" and t, "the ETA")

    browser.find_element(By.ID, "job-cancel").click()
    WebDriverWait(browser, 10).until(expected_conditions.alert_is_present())
    browser.switch_to.alert.accept()
    _wait_for(
        lambda: _element(browser, "#job-status").get_attribute("data-status") == "cancelled", "cancelled"
    )
    assert service.client.get(f"/v1/fine_tuning/jobs/{job_id}").json()["status"] == "cancelled"
    assert not browser.find_element(By.ID, "job-cancel").is_enabled()


def test_the_api_docs_pages_load_nothing_from_elsewhere(browser, tmp_path):
    """Swagger UI (/docs) and ReDoc (/redoc) draw the API from files the server ships, so they work offline."""
    with running_service(tmp_path / "data", {"FUSETUNE_EMBEDDED_WORKER": "false"}) as service:
        _docs_pages_load_nothing_from_elsewhere(browser, service.base_url)


def _docs_pages_load_nothing_from_elsewhere(browser, base: str) -> None:
    elsewhere = (
        "return performance.getEntriesByType('resource').map(e => e.name)"
        ".filter(name => !name.startsWith(arguments[0]) && !/^(blob|data):/.test(name));"
    )
    browser.get(f"{base}/docs")
    _element(browser, ".swagger-ui .opblock")  # an operation, drawn from /openapi.json
    assert "/v1/fine_tuning/jobs" in _text(browser, ".swagger-ui")
    assert browser.execute_script(elsewhere, base) == []
    browser.get(f"{base}/redoc")
    _element(browser, "[data-section-id]")
    assert "fusetune" in _text(browser, "h1")
    assert browser.execute_script(elsewhere, base) == []


def test_the_job_page_shows_the_eval_runs_of_its_model(dashboard, demo):
    """A run of the job's fine-tuned model, written as the worker ends one, shows on the job's page with its pass
    rate and each criterion's."""
    from fusetune.db.models import Eval, EvalRun
    from fusetune.db.session import make_engine, make_session_factory

    service, job = demo.service, demo.finished
    with make_session_factory(make_engine(service.settings.database_url))() as session:
        evaluation = Eval(tenant="default", name="digits", data_source_config={}, testing_criteria=[])
        session.add(evaluation)
        session.flush()
        run = EvalRun(eval_id=evaluation.id, tenant="default", name="tuned on digits", status="completed",
                      model=job["fine_tuned_model"], data_source={},
                      result_counts={"total": 4, "passed": 3, "failed": 1, "errored": 0},
                      per_testing_criteria_results=[{"testing_criteria": "exact", "passed": 3, "failed": 1}])  # fmt: skip
        session.add(run)
        session.commit()
        run_id = run.id
    dashboard.get(f"{service.base_url}/ui/#/jobs/{job['id']}")
    row = f"#job-eval-runs tr[data-run-id='{run_id}']"
    assert _text(dashboard, f"{row} .eval-pass-rate") == "3/4 (75%)"
    assert "exact: 3/4 (75%)" in _text(dashboard, row)
