// Optional check that the explorer widget renders and responds inside a real JupyterLab.
// Not part of `make test` (it needs a browser).  On Debian/Ubuntu, from the repository root:
//   apt-get install chromium && (cd /tmp && npm install playwright-core)
//   mkdir -p /tmp/labcheck && .venv/bin/python -c "import nbformat as n; nb = n.v4.new_notebook(cells=[n.v4.new_code_cell('import pipelab as pl\npl.widgets.explorer()')]); n.write(nb, '/tmp/labcheck/explorer_check.ipynb')"
//   .venv/bin/python -m jupyterlab --no-browser --allow-root --port 8898 --IdentityProvider.token=abc --ServerApp.root_dir=/tmp/labcheck &
//   NODE_PATH=/tmp/node_modules node scripts/explorer_in_jupyterlab.js
// It runs the cell, moves the micro-batches slider to its maximum (64), presses "run it for real",
// prints the explorer's summary line and writes /tmp/explorer_before.png and /tmp/explorer_after.png.
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
  await page.keyboard.press('End');
  await page.waitForTimeout(4000);
  await page.click('button:has-text("run it for real")');
  await page.waitForTimeout(20000);
  await page.screenshot({ path: '/tmp/explorer_after.png' });
  const text = await page.$eval('.widget-html-content', (el) => el.textContent);
  console.log(text);
  await browser.close();
  if (!text.includes('m=64')) process.exit(1);
})().catch((error) => { console.error(error); process.exit(1); });
