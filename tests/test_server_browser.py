"""The web page in headless Chromium (selenium): load the demo model, stream a story, stop it, chat; the picker
shows the loaded model, and what cannot work is disabled; screenshots go to tests/_artifacts/."""

from __future__ import annotations

import contextlib
import time
from pathlib import Path
from typing import Any, Iterator

import pytest
import requests

from kobold_backend.demo import shipped_demo_dir
from kobold_backend.engine.chat_template import ChatFormatter
from kobold_backend.engine.tokenizer import load_tokenizer
from kobold_backend.server import ServerConfig, create_app
from kobold_backend.server.engine_holder import EngineHolder
from tests.server_helpers import live_server, slow_loader

CHROMIUM = Path("/usr/bin/chromium")
CHROMEDRIVER = Path("/usr/bin/chromedriver")
ARTIFACTS = Path(__file__).resolve().parent / "_artifacts"
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
         "--disable-component-update", "--disable-sync", "--no-first-run", "--window-size=1280,900"]

pytestmark = pytest.mark.skipif(
    not (CHROMIUM.exists() and CHROMEDRIVER.exists()),
    reason="needs /usr/bin/chromium and /usr/bin/chromedriver (apt-get install -y chromium chromium-driver)",
)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Any:
    cache = tmp_path_factory.mktemp("xdg_cache")
    models = tmp_path_factory.mktemp("models")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("XDG_CACHE_HOME", str(cache))
        # Every forward pass takes 30 ms longer, so that a generation lasts long enough to be stopped.
        holder = EngineHolder(loader=slow_loader(0.03), load_kwargs={"device": "cpu"})
        app = create_app(ServerConfig(models_dir=models), holder)
        with live_server(app) as srv:
            yield srv


@pytest.fixture(scope="module")
def browser() -> Any:
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = str(CHROMIUM)
    for flag in FLAGS:
        options.add_argument(flag)
    driver = webdriver.Chrome(service=Service(str(CHROMEDRIVER)), options=options)
    driver.set_page_load_timeout(30)
    yield driver
    driver.quit()


def wait_until(predicate: Any, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while True:
        if predicate():
            return
        if time.monotonic() > deadline:
            raise AssertionError("the page did not reach the expected state")
        time.sleep(0.1)


def shot(driver: Any, name: str) -> None:
    ARTIFACTS.mkdir(exist_ok=True)
    driver.save_screenshot(str(ARTIFACTS / f"{name}.png"))


def test_load_demo_stream_and_stop(server: Any, browser: Any) -> None:
    from selenium.webdriver.common.by import By
    from selenium.webdriver.common.keys import Keys
    from selenium.webdriver.support.ui import Select

    by_id = lambda name: browser.find_element(By.ID, name)  # noqa: E731
    browser.get(server.url + "/")
    wait_until(lambda: "no model loaded" in by_id("status").text)
    wait_until(lambda: len(Select(by_id("model-select")).options) >= 1)
    Select(by_id("model-select")).select_by_value("__demo__")
    wait_until(lambda: "max_ctx" in [e.get_attribute("data-param-id")
                                     for e in browser.find_elements(By.CSS_SELECTOR, "[data-param-id]")])
    ctx = browser.find_element(By.CSS_SELECTOR, "input[type=number][data-param-id=max_ctx]")
    ctx.clear()
    ctx.send_keys("512")
    by_id("load-btn").click()
    wait_until(lambda: by_id("status").text.startswith("model:"), timeout=240)
    assert "context 512 tokens" in by_id("status").text
    assert "· GPTQ 4-bit g64, 4.41 bpw ·" in by_id("status").text  # the demo's weight format, as /ui/status says
    assert by_id("demo-badge").is_displayed()
    assert "trained on licence texts" in by_id("demo-badge").text
    shot(browser, "1-demo-loaded")

    for name, value in (("max_length", "300"), ("temperature", "0.8"), ("sampler_seed", "11")):
        field = by_id(name)
        field.clear()
        field.send_keys(value)
    by_id("ban_eos").click()  # the trained demo model may end its text early; this test needs a long stream
    story = by_id("story")
    story.send_keys("Once upon a time")
    by_id("generate-btn").click()
    wait_until(lambda: len(story.get_property("value")) > len("Once upon a time") + 20, timeout=30)
    assert by_id("stop-btn").is_enabled()
    assert not by_id("generate-btn").is_enabled()
    during = len(story.get_property("value"))
    time.sleep(0.3)
    assert len(story.get_property("value")) > during  # still streaming
    assert "tokens/s" in by_id("speed").text
    shot(browser, "2-streaming")

    by_id("stop-btn").click()
    wait_until(lambda: by_id("generate-btn").is_enabled(), timeout=10)
    stopped_at = story.get_property("value")
    time.sleep(0.5)
    assert story.get_property("value") == stopped_at
    assert by_id("finish").text == "finished: length"
    assert "Stopped" in by_id("gen-msg").text
    perf = requests.get(server.url + "/api/extra/perf", timeout=10).json()
    assert 0 < perf["last_token_count"] < 300 and perf["idle"] == 1
    assert "tokens/s" in by_id("speed").text and "…" not in by_id("speed").text
    shot(browser, "3-stopped")

    by_id("memory").send_keys("Answer briefly.")  # on the Story tab; the chat sends it as the system message
    by_id("tab-chat").click()
    assert "chat template" in by_id("chat-mode").text  # the demo model ships one
    length = by_id("max_length")
    length.clear()
    length.send_keys("6")
    by_id("chat-input").send_keys("Hello bot")
    by_id("chat-input").send_keys(Keys.CONTROL, Keys.ENTER)
    wait_until(lambda: by_id("generate-btn").is_enabled() and len(
        browser.find_elements(By.CSS_SELECTOR, "#chat-log > div")) == 2, timeout=30)
    lines = [e.text for e in browser.find_elements(By.CSS_SELECTOR, "#chat-log > div")]
    assert lines[0] == "User: Hello bot" and lines[1].startswith("Assistant:")
    assert by_id("gen-msg").text == ""
    # The prompt was the demo's chat template (memory as the system paragraph), not "Name: text" lines.
    demo = shipped_demo_dir()
    assert demo is not None
    lm_tokenizer = load_tokenizer(demo)
    formatter = ChatFormatter(lm_tokenizer.chat_template, lm_tokenizer, demo)
    messages = [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "Hello bot"}]
    rendered = formatter.encode(formatter.render(messages))
    plain = [lm_tokenizer.bos_id] + lm_tokenizer.encode("Answer briefly.User: Hello bot\nAssistant:")
    assert len(rendered) != len(plain)
    assert requests.get(server.url + "/api/extra/perf", timeout=10).json()["last_input_count"] == len(rendered)
    shot(browser, "4-chat")


@pytest.fixture(scope="module")
def served_gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A models folder holding one GGUF file (and no demo model is loaded)."""
    from tests.fixtures.checkpoints import CheckpointSpec, build_checkpoint
    from tests.fixtures.gguf_files import write_gguf

    root = tmp_path_factory.mktemp("page_gguf")
    hf = build_checkpoint(CheckpointSpec("page_gguf", seed=45), root / "hf").path
    write_gguf(hf, root / "written", {"token_embd": "F16", "*": "Q8_0"})
    models = root / "models"
    models.mkdir()
    (root / "written" / "model.gguf").rename(models / "story.gguf")
    return models


@contextlib.contextmanager
def page_with_gguf_loaded(browser: Any, models: Path, models_dir: Any) -> Iterator[Any]:
    """Serve story.gguf (loaded at start, as `serve --model`), with or without --models-dir; open the page and
    yield its element finder."""
    from selenium.webdriver.common.by import By

    holder = EngineHolder(load_kwargs={"device": "cpu"})
    holder.load(models / "story.gguf")
    with live_server(create_app(ServerConfig(models_dir=models_dir), holder)) as srv:
        browser.get(srv.url + "/")
        by_id = lambda name: browser.find_element(By.ID, name)  # noqa: E731
        wait_until(lambda: by_id("status").text.startswith("model: story.gguf"))
        wait_until(lambda: "(loaded)" in by_id("model-select").text)
        yield by_id


# The dropdown texts wider than their select (the select shows one line: the rest is cut off).
CUT_OFF = """
const cut = [];
for (const sel of document.querySelectorAll('#load-params select')) {
  const cs = getComputedStyle(sel);
  const ctx = document.createElement('canvas').getContext('2d');
  ctx.font = cs.font;
  const room = sel.clientWidth - parseFloat(cs.paddingLeft) - parseFloat(cs.paddingRight) - 20;
  for (const o of sel.options) if (ctx.measureText(o.text).width > room) cut.push(o.text);
}
return cut;
"""


def test_the_picker_shows_the_loaded_gguf_and_no_option_is_cut_off(served_gguf: Path, browser: Any) -> None:
    """The picker said "Demo model (built in)" while a GGUF was loaded; the dtype option was cut off."""
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import Select

    with page_with_gguf_loaded(browser, served_gguf, served_gguf) as by_id:
        picker = Select(by_id("model-select"))
        assert picker.first_selected_option.get_attribute("value") == "story.gguf"
        assert picker.first_selected_option.text == "story.gguf (loaded)"
        assert [o.text for o in picker.options] == ["Demo model (built in)", "story.gguf (loaded)"]
        wait_until(lambda: browser.find_elements(By.CSS_SELECTOR, "select[data-param-id=cache_dtype]"))
        assert by_id("load-btn").is_enabled() and by_id("model-select").is_enabled()
        assert browser.execute_script(CUT_OFF) == []
        shot(browser, "5-gguf-loaded")


def test_without_models_dir_nothing_that_cannot_work_is_enabled(served_gguf: Path, browser: Any) -> None:
    """Without --models-dir the page showed the demo in the picker, a red note and an enabled Load button."""
    from selenium.webdriver.support.ui import Select

    with page_with_gguf_loaded(browser, served_gguf, None) as by_id:
        picker = Select(by_id("model-select"))
        assert [o.text for o in picker.options] == ["story.gguf (loaded)"]
        assert not by_id("model-select").is_enabled() and not by_id("load-btn").is_enabled()
        assert not by_id("load-params").is_displayed()
        note = by_id("load-msg")
        assert "--models-dir" in note.text and "error" not in (note.get_attribute("class") or "")
        shot(browser, "6-no-models-dir")
