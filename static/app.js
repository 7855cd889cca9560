// Draws every Plotly figure on the page (and in fragments htmx swaps in) from its JSON script tag.
(function () {
  // In the dark theme a chart takes the page's ground, inks and lines (static/app.css).
  function themed(layout) {
    if (!window.matchMedia("(prefers-color-scheme: dark)").matches) return layout;
    var css = getComputedStyle(document.documentElement);
    var ink = css.getPropertyValue("--ink").trim(), line = css.getPropertyValue("--line").trim();
    layout.paper_bgcolor = layout.plot_bgcolor = "rgba(0,0,0,0)";
    layout.font = Object.assign({}, layout.font, {color: ink});
    ["xaxis", "yaxis"].forEach(function (name) {
      if (layout[name]) Object.assign(layout[name], {gridcolor: line, zerolinecolor: line, linecolor: line});
    });
    return layout;
  }
  function draw(root) {
    root.querySelectorAll("[data-figure-id]").forEach(function (el) {
      if (el.dataset.drawn || !window.Plotly) return;
      var figure = JSON.parse(document.getElementById(el.dataset.figureId).textContent);
      window.Plotly.newPlot(el, figure.data, themed(figure.layout), {displaylogo: false, responsive: true});
      el.dataset.drawn = "1";
    });
  }
  window.addEventListener("load", function () { draw(document); });
  document.addEventListener("htmx:afterSettle", function (event) { draw(event.target); });
})();

// A confirmation that names what is being done: a form with data-confirm="... {choice} ..." asks
// with the selected option's label in place of {choice}, when it is sent (not when a field in it
// asks for something, as the deploy form's check of a release's fit does).
document.addEventListener("htmx:confirm", function (event) {
  var form = event.target;
  if (!form.matches || !form.matches("form[data-confirm]")) return;
  event.preventDefault();
  var select = form.querySelector("select");
  var choice = select ? select.options[select.selectedIndex].text : "";
  if (window.confirm(form.dataset.confirm.replace("{choice}", choice))) event.detail.issueRequest(true);
});

// Times are shown in UTC, said so (controlplane/times.py), so people in several zones read the
// same time; hovering one shows it in the viewer's own zone as well.
(function () {
  var zone = Intl.DateTimeFormat().resolvedOptions().timeZone;
  function localise(root) {
    root.querySelectorAll("time[datetime]:not([title])").forEach(function (el) {
      var at = new Date(el.getAttribute("datetime"));
      if (isNaN(at)) return;
      var local = at.toLocaleDateString("sv-SE") + " " + at.toLocaleTimeString("sv-SE");
      var utc = at.toISOString().slice(0, 19).replace("T", " ");
      el.title = utc + " UTC; " + local + " your time (" + zone + ")";
    });
  }
  window.addEventListener("DOMContentLoaded", function () { localise(document); });
  document.addEventListener("htmx:afterSettle", function (event) { localise(event.target); });
})();

// A live part of a page does not refresh under someone filling a field in it (a reason, say):
// its poll waits while a field there has the focus or holds text not yet sent.
document.addEventListener("htmx:beforeRequest", function (event) {
  var live = event.detail.elt;
  if (!live.matches || !/^every /.test(live.getAttribute("hx-trigger") || "")) return;
  var fields = live.querySelectorAll("input:not([type=hidden]), textarea");
  for (var i = 0; i < fields.length; i++) {
    if (fields[i] === document.activeElement || fields[i].value) {
      event.preventDefault();
      return;
    }
  }
});

// A live part's poll is not the person at the page: marked, it does not keep the session alive
// (controlplane/sessions.py). Only the polling element's own requests: not a form inside it.
document.addEventListener("htmx:configRequest", function (event) {
  var elt = event.detail.elt;
  if (!elt.getAttribute || !/(^|,)\s*every /.test(elt.getAttribute("hx-trigger") || "")) return;
  event.detail.headers["X-Poll"] = "1";
});

// A refused or failed action says why where it was clicked, as an alert a screen reader
// announces: the page's own message for a 4xx or 5xx (a role that does not allow it, a
// conflict, bad input, too many tries), or that the server could not be reached. htmx swaps
// nothing on an error by itself, so without this a refused click changed nothing visible.
(function () {
  function say(elt, text) {
    var near = (elt.closest && elt.closest("form")) || elt;
    var alert = near.nextElementSibling;
    if (!alert || !alert.classList.contains("refusal")) {
      alert = document.createElement("p");
      alert.className = "flash error refusal";
      alert.setAttribute("role", "alert");
      near.insertAdjacentElement("afterend", alert);
    }
    alert.textContent = text;
  }
  function reason(xhr) {
    var page = new DOMParser().parseFromString(xhr.responseText || "", "text/html");
    var found = page.querySelector(".flash.error, main .card p, main p");
    var text = found ? found.textContent.replace(/\s+/g, " ").trim() : "";
    return text || "Refused by the server (HTTP " + xhr.status + "): nothing was done.";
  }
  document.addEventListener("htmx:responseError", function (event) {
    say(event.detail.elt, reason(event.detail.xhr));
  });
  document.addEventListener("htmx:sendError", function (event) {
    say(event.detail.elt, "The server could not be reached: nothing was done. Try again.");
  });
})();
