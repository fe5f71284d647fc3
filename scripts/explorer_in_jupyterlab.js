// Optional check that the explorer widget renders and responds inside a real JupyterLab.
// Not part of `make test` (it needs a browser).  On Debian/Ubuntu, from the repository root:
//   apt-get install chromium && (cd /tmp && npm install playwright-core)
//   mkdir -p /tmp/labcheck && .venv/bin/python -c "import nbformat as n; nb = n.v4.new_notebook(cells=[n.v4.new_code_cell('import pipelab as pl\npl.widgets.explorer()')], metadata={'kernelspec': {'name': 'python3', 'display_name': 'Python 3', 'language': 'python'}}); n.write(nb, '/tmp/labcheck/explorer_check.ipynb')"
//   .venv/bin/python -m jupyterlab --no-browser --allow-root --port 8898 --IdentityProvider.token=abc --ServerApp.root_dir=/tmp/labcheck &
//   NODE_PATH=/tmp/node_modules node scripts/explorer_in_jupyterlab.js
// It runs the cell, moves the micro-batches slider to 64 (the timeline and memory redraw), then to 1
// and presses "run it for real" (predicted above measured); it fails unless all three pictures show
// up with ink on them.  Screenshots: /tmp/explorer_before.png, _middle.png, _after.png.
const { chromium } = require('playwright-core');

(async () => {
  const notebook = process.argv[2] || 'explorer_check.ipynb';
  const browser = await chromium.launch({
    executablePath: process.env.CHROMIUM || '/usr/bin/chromium',
    args: ['--headless', '--no-sandbox', '--disable-gpu', '--disable-background-networking', '--no-first-run'],
  });
  const page = await browser.newPage({ viewport: { width: 1400, height: 1300 } });
  await page.goto(`http://127.0.0.1:8898/lab/tree/${notebook}?token=abc`);
  await page.waitForSelector('.jp-Notebook', { timeout: 60000 });
  await page.waitForTimeout(8000); // the kernel starts
  await page.click('.jp-Cell .jp-InputArea-editor');
  await page.keyboard.press('Shift+Enter');
  await page.waitForSelector('.widget-slider', { timeout: 90000 });
  await page.waitForTimeout(5000);
  await page.screenshot({ path: '/tmp/explorer_before.png' });
  const sliders = await page.$$('.widget-slider [role=slider], .widget-slider .noUi-handle');
  await sliders[1].focus(); // micro-batches
  await page.keyboard.press('End'); // 64: the simulator redraws at once
  await page.waitForTimeout(4000);
  const text = await page.$eval('.widget-html-content', (el) => el.textContent);
  await page.screenshot({ path: '/tmp/explorer_middle.png' });
  await sliders[1].focus();
  await page.keyboard.press('Home'); // 1 micro-batch: small enough for a real CPU run
  await page.waitForTimeout(3000);
  await page.click('button:has-text("run it for real")');
  await page.waitForTimeout(25000);
  await page.screenshot({ path: '/tmp/explorer_after.png' });
  // each shown picture must have ink on it: count its dark pixels (a blank figure has none)
  const inks = await page.$$eval('.widget-image', (els) => els.filter((e) => e.offsetParent).map((e) => {
    const canvas = document.createElement('canvas');
    canvas.width = e.naturalWidth;
    canvas.height = e.naturalHeight;
    const context = canvas.getContext('2d');
    context.drawImage(e, 0, 0);
    const pixels = context.getImageData(0, 0, canvas.width, canvas.height).data;
    let dark = 0;
    for (let i = 0; i < pixels.length; i += 4) if (pixels[i] < 200) dark += 1;
    return dark;
  }));
  console.log(text, '| dark pixels per picture:', inks.join(', '));
  await browser.close();
  if (!text.includes('m=64') || inks.length < 3 || Math.min(...inks) < 1000) process.exit(1);
})().catch((error) => { console.error(error); process.exit(1); });
